"""The training objective (`finetune.objective`): what a `TrainStep`'s loss is, one interface for all of them.

The step's loop (`TrainStep.forward_backward`, `TrainStep.eval_sums`) is the same whatever the objective: it asks
the objective for the unit its loss is a mean over (`count`: target tokens, or pairs), for each micro batch's
summed loss with the sums of the objective's logged metrics (`micro_loss`), and hands it the step's metric sums
over all ranks, divided by the step's count (`observe`); the trainer logs `metrics` beside the loss.

    sft     next-token cross-entropy on the target tokens, no metrics (fitlm.step.sft_objective)
    dpo     Direct Preference Optimization on pairs (fitlm.step.pair_objectives)
    simpo   SimPO on the same pairs, no reference (fitlm.step.pair_objectives)
    grpo    GRPO on completions sampled before the step (fitlm.step.grpo_objective, fitlm.step.rollout)

An MoE model's load-balancing loss is not part of the objective: the step adds it to whichever objective's loss
(fitlm.step.router_balance). Neither is the pipeline-parallel loss, computed inside the schedule; only SFT runs
under pipeline parallel (fitlm.rules refuses the others there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from fitlm.config import Config
from fitlm.step.grpo_objective import GrpoObjective
from fitlm.step.pair_objectives import pair_objective
from fitlm.step.sft_objective import SFTObjective

if TYPE_CHECKING:
    from fitlm.parallel.apply import ParallelModel
    from fitlm.parallel.mesh import ParallelContext
    from fitlm.step.train_step import TrainStep


class Objective(Protocol):
    """What an objective gives a `TrainStep` (its loop) and the trainer (its log)."""

    metrics: dict[str, float]  # the last step's metrics, logged beside the loss ({} when it has none)

    def count(self, labels: torch.Tensor) -> int:
        """What the step's loss is a mean over in a micro batch's `labels` [B, T]: target tokens, or pairs."""
        ...

    def micro_loss(
        self, step: TrainStep, input_ids: torch.Tensor, labels: torch.Tensor, doc: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss of one micro batch through `step`'s model, with its gradient; the detached sums of the
        objective's metrics over the micro batch [k], k = 0 when it has none)."""
        ...

    def observe(self, means: torch.Tensor) -> None:
        """The step's metric sums [k] over all ranks and micro batches, divided by the step's count: sets
        `metrics`."""
        ...


def objective_for(cfg: Config, ctx: ParallelContext, pm: ParallelModel, simulate: bool = False) -> Objective:
    """The step's objective for finetune.objective. `simulate`: the step runs on fake tensors (`fitlm plan
    --simulate`), where DPO's policy stands in for a frozen reference copy."""
    if cfg.finetune.pairs:
        return pair_objective(cfg, ctx, pm, simulate)
    if cfg.finetune.objective == "grpo":
        return GrpoObjective(cfg.finetune.grpo, cfg.train.gradient_accumulation_steps)
    return SFTObjective()


__all__ = ["Objective", "objective_for"]
