"""Preference objectives on pairs: Direct Preference Optimization (`finetune.objective: dpo`) and SimPO
(`finetune.objective: simpo`, Meng et al. 2024), the step's loss on preference pairs.

A micro batch of B pairs is 2B rows (`fitlm.data.loader`, packing "pairs"): the B chosen sequences, then
the B rejected ones, labels only on response tokens. Both objectives score each row, turn the scores into
rewards β · score and take, per pair,

    loss = −log σ(reward(chosen) − reward(rejected) − γ)

DPO's score is the log-ratio log π(response | prompt) − log π_ref(response | prompt), each summed over the
row's target tokens, with γ = 0:

    loss = −log σ(β · ((log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r))))

SimPO's is the policy's length-normalized log-prob (the summed log-prob divided by the row's response
tokens), with no reference, and γ = finetune.simpo.gamma, the target reward margin (TRL's CPOTrainer with
loss_type "simpo": −log σ(β · (avg log π(c) − avg log π(r) − γ/β))).

The step's loss is the mean over all of the step's pairs on all data-parallel ranks (each micro batch's
summed pair losses divided by the global pair count, times the dp degree that gradient averaging divides
by: the SFT step's token weighting, with pairs for tokens). The rewards of chosen and rejected, their margin
and how often chosen wins are logged beside the loss.

DPO's reference is the starting model: under LoRA the same module with its adapters switched off
(`fitlm.finetune.lora.adapters_off`, no second copy); for full and freeze fine-tuning, or for the model
directory `finetune.dpo.reference` names, a frozen copy on every rank (requires_grad off, no optimizer
state, not sharded by ZeRO), stored in the run's precision. SimPO has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.config import Config, ConfigError, ModelConfig
from fitlm.finetune.errors import FinetuneError
from fitlm.finetune.lora import adapters_off
from fitlm.memory.precision import apply_precision
from fitlm.models.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from fitlm.parallel.apply import ParallelModel
    from fitlm.parallel.mesh import ParallelContext
    from fitlm.step.train_step import TrainStep

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p of each row's target tokens, summed, in fp32: logits [N, T, V], labels [N, T] -> [N]."""
    per_token = -F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )  # [N·T], 0 where ignored
    return per_token.view(labels.shape).sum(-1)


def average_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p of each row's target tokens divided by their count (SimPO's length normalization), [N]; a row
    without targets (a response truncated away) scores 0, as its sum does."""
    return sequence_logps(logits, labels) / (labels != IGNORE_INDEX).sum(-1).clamp(min=1)


def pair_terms(
    scores: torch.Tensor, beta: float, gamma: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward), each [B], from the [2B] row scores (the B chosen rows first):
    rewards β · score, loss −log σ(chosen reward − rejected reward − γ)."""
    chosen, rejected = (beta * scores).chunk(2)
    return -F.logsigmoid(chosen - rejected - gamma), chosen, rejected


def pair_count(labels: torch.Tensor) -> int:
    """Pairs in a micro batch of 2B rows; a batch that is not whole pairs cannot be scored."""
    rows = labels.shape[0]
    if rows % 2:
        raise FinetuneError(
            f"a preference micro batch holds 2 × train.micro_batch_size rows (chosen, then "
            f"rejected); got {rows} rows: feed it from data packed with "
            f"`fitlm data pack --format preference`"
        )
    return rows // 2


# How a preference objective scores the rows of a micro batch: (policy, input_ids [2B, T], labels [2B, T], doc)
# -> [2B] scores, with the policy's gradient.
Score = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict], torch.Tensor]


class PairObjective:
    """A preference objective (fitlm.step.objectives.Objective): the unit its loss is a mean over (pairs), each
    micro batch's summed loss with its metric sums, and the metrics of the last step. `score` says how a row is
    scored (`dpo_score`, `simpo_score`); rewards are β · score, and the pair's loss is −log σ(chosen reward −
    rejected reward − γ)."""

    def __init__(self, beta: float, score: Score, gamma: float = 0.0):
        self.beta, self.gamma, self.score = beta, gamma, score
        self.metrics: dict[str, float] = {}

    @staticmethod
    def count(labels: torch.Tensor) -> int:
        return pair_count(labels)

    def micro_loss(
        self, step: "TrainStep", input_ids: torch.Tensor, labels: torch.Tensor, doc: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed pair loss of a micro batch [2B, T], detached [chosen reward, rejected reward, chosen wins]
        summed over its pairs)."""
        scores = self.score(step.pm.model, input_ids, labels, doc)
        loss, chosen, rejected = pair_terms(scores, self.beta, self.gamma)
        return loss.sum(), torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).sum()]).detach()

    def observe(self, means: torch.Tensor) -> None:
        """The step's metric sums over all ranks, divided by its pairs: [chosen, rejected, wins]."""
        chosen, rejected, wins = (float(v) for v in means)
        self.metrics = dict(zip(METRICS, (chosen, rejected, chosen - rejected, wins)))


def dpo_score(reference: Callable[..., torch.Tensor]) -> Score:
    """DPO: a row's score is the policy's summed log-prob minus the frozen reference's (`reference`:
    (input_ids [2B, T], **doc) -> logits [2B, T, V], run without gradients)."""

    def score(policy: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, doc: dict) -> torch.Tensor:
        with torch.no_grad():  # first: its logits are freed before the policy's forward
            ref = sequence_logps(reference(input_ids, **doc), labels)  # [2B]
        return sequence_logps(policy(input_ids, **doc), labels) - ref

    return score


def simpo_score(policy: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, doc: dict) -> torch.Tensor:
    """SimPO: a row's score is the policy's length-normalized log-prob; no reference."""
    return average_logps(policy(input_ids, **doc), labels)


def reference_config(cfg: Config) -> Config:
    """The config that builds the reference: the run's own starting model without adapters, or the model
    directory finetune.dpo.reference (its network read from it, as model.init_from is)."""
    from fitlm.finetune.init_from import resolve_init_from

    path = cfg.finetune.dpo.reference
    model = cfg.model if path is None else ModelConfig(init_from=path)
    plain = cfg.finetune.model_copy(update={"method": "full"})  # no adapters, nothing frozen by the method
    ref = resolve_init_from(cfg.model_copy(update={"model": model, "finetune": plain}))
    if ref.model.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            [
                f"finetune.dpo.reference: {path} has a vocabulary of {ref.model.vocab_size} tokens but the "
                f"trained model has {cfg.model.vocab_size}; the reference must share the tokenizer"
            ]
        )
    return ref


def frozen_copy(cfg: Config, ctx: "ParallelContext") -> nn.Module:
    """The reference as a plain frozen module on this rank's device: built on meta, filled with the weights
    `reference_config` starts from, stored as the run's precision stores weights."""
    from fitlm.finetune.initial_weights import initial_weights
    from fitlm.parallel.materialize import materialize, tied_aliases
    from fitlm.registry import build_model

    ref = reference_config(cfg)
    with torch.device("meta"):
        model = build_model(ref.model)
    materialize([model], initial_weights(ref, model), ctx.device, tied_aliases(model))
    model.requires_grad_(False)
    return apply_precision(model, cfg.memory, sharded=False).eval()


def pair_objective(cfg: Config, ctx: "ParallelContext", pm: "ParallelModel", simulate: bool = False) -> PairObjective:
    """The pair objective of finetune.objective `dpo` or `simpo` (fitlm.step.objectives.objective_for), DPO with
    its reference: adapters off under LoRA, else a frozen copy (under `simulate`, the policy stands in)."""
    f = cfg.finetune
    if f.objective == "simpo":
        return PairObjective(f.simpo.beta, simpo_score, f.simpo.gamma)
    if f.objective != "dpo":
        raise ValueError(f"finetune.objective: {f.objective!r} is not a pair objective (dpo, simpo)")
    if f.adapters and f.dpo.reference is None:

        def base(input_ids: torch.Tensor, **doc: torch.Tensor) -> torch.Tensor:
            with adapters_off(pm.model):
                return pm.model(input_ids, **doc)

        return PairObjective(f.dpo.beta, dpo_score(base))
    if simulate:
        # A simulation measures the step on fake tensors: the policy stands in for the reference's forward.
        # The frozen copy's bytes are the planner's to add (they are the model's weights once more).
        return PairObjective(f.dpo.beta, dpo_score(lambda input_ids, **doc: pm.model(input_ids, **doc)))
    return PairObjective(f.dpo.beta, dpo_score(frozen_copy(cfg, ctx)))


__all__ = [
    "METRICS",
    "PairObjective",
    "Score",
    "average_logps",
    "dpo_score",
    "frozen_copy",
    "pair_count",
    "pair_objective",
    "pair_terms",
    "reference_config",
    "sequence_logps",
    "simpo_score",
]
