"""Group Relative Policy Optimization as the step's objective (`finetune.objective: grpo`,
fitlm.step.objectives.Objective): each micro batch of sampled completions (fitlm.step.rollout) through the
policy, its loss by fitlm.step.grpo_loss, and the step's metrics (TRL's names).

The step's loop divides each micro batch's loss by what `count` returns, summed over the step's micro batches
and the data-parallel ranks, and multiplies by the ranks (the gradient average over ranks then sums). GRPO's
loss is already TRL's per-micro-batch value, so `count` is 1 per micro batch: the loop then divides by the
accumulation steps, as TRL does for grpo, bnpo and dr_grpo. dapo's denominator already spans the step, so
it is handed the step's tokens per rank divided by the accumulation steps, which the loop's division undoes.

The rollout of the step is handed over by `begin` before the loop; `micro_loss` takes its micro batches in
order and checks each is the one the loop passes. Without a rollout (`fitlm plan --simulate` on fake
tensors) a micro batch counts every label with advantage 0: the same computation on the same shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fitlm.config.schema import GrpoConfig
from fitlm.models.loss import IGNORE_INDEX
from fitlm.step.grpo_loss import grpo_loss
from fitlm.step.rollout import MicroRollout, Rollout, token_logps

if TYPE_CHECKING:
    from fitlm.parallel.mesh import ParallelContext
    from fitlm.step.train_step import TrainStep

LOSS_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")
# Rollout metrics reduced over data-parallel ranks by their largest value (the rest by their mean, or summed)
MAX_METRICS = ("completions/max_length", "sampling_seconds")
SUM_METRICS = ("sampling_tokens", "loss_tokens", "train_tokens")


class GrpoObjective:
    def __init__(self, cfg: GrpoConfig, accumulation: int):
        self.cfg, self.accumulation = cfg, accumulation
        self.metrics: dict[str, float] = {}
        self.pending: list[MicroRollout] = []
        self.rollout_metrics: dict[str, float] = {}
        self.tokens_per_rank = 1.0
        self.step_tokens = 0.0  # the step's sequence tokens (prompt + completion) over all ranks

    @staticmethod
    def count(labels: torch.Tensor) -> int:
        return 1

    def begin(self, rollout: Rollout, ctx: ParallelContext) -> None:
        """Hand over the step's micro batches; the rollout's metrics are reduced over the data-parallel ranks
        (a collective: every rank calls it)."""
        self.pending = list(rollout.micro)
        names = sorted(rollout.metrics)
        local = torch.tensor([rollout.metrics[k] for k in names], dtype=torch.float64, device=ctx.device)
        summed = ctx.all_reduce_sum(local.clone(), "dp")
        largest = ctx.all_reduce_max(local.clone(), "dp")
        out = {}
        for i, k in enumerate(names):
            if k in MAX_METRICS:
                out[k] = float(largest[i])
            elif k in SUM_METRICS:
                out[k] = float(summed[i])
            else:
                out[k] = float(summed[i]) / ctx.dp
        self.tokens_per_rank = out["loss_tokens"] / ctx.dp
        self.rollout_metrics = out

    def _next(self, input_ids: torch.Tensor, labels: torch.Tensor) -> MicroRollout:
        if not self.pending:  # a simulation (fitlm plan --simulate): the shapes, advantage 0
            mask = (labels != IGNORE_INDEX).float()
            return MicroRollout(input_ids, labels, torch.zeros(labels.shape[0], device=labels.device), mask)
        mb = self.pending.pop(0)
        if mb.input_ids.shape != input_ids.shape or not torch.equal(mb.input_ids, input_ids):
            raise RuntimeError("GRPO's micro batches reached the step out of order; the step must run them in turn")
        return mb

    def micro_loss(
        self, step: TrainStep, input_ids: torch.Tensor, labels: torch.Tensor, doc: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro batch's loss as TRL computes it, the detached [clip low, high, region, kl] of it)."""
        mb = self._next(input_ids, labels)
        new = token_logps(step.pm.model(input_ids, **doc), labels, self.cfg.temperature)  # [b, T]
        ref = mb.ref if mb.ref is not None or self.cfg.beta == 0 else new.detach()  # (simulation: no reference)
        out = grpo_loss(new, mb.old, ref, mb.advantages, mb.mask, self.cfg, 1, self.tokens_per_rank / self.accumulation)
        values = [out.metrics[k] for k in LOSS_METRICS[:3]] + [out.metrics.get("kl", 0.0)]
        return out.loss, torch.tensor(values, device=out.loss.device)

    def observe(self, means: torch.Tensor) -> None:
        """The loss metrics averaged over the step's micro batches and ranks, beside the rollout's."""
        names = LOSS_METRICS if self.cfg.beta else LOSS_METRICS[:3]
        self.metrics = {**self.rollout_metrics, **{k: float(v) for k, v in zip(names, means.tolist())}}
        tokens, seconds = self.metrics.pop("sampling_tokens", 0.0), self.metrics.pop("sampling_seconds", 0.0)
        self.metrics.pop("loss_tokens", None)
        self.step_tokens = self.metrics.pop("train_tokens", 0.0)
        if seconds:
            self.metrics["sampling_seconds"] = seconds
            self.metrics["sampling_tokens_per_s"] = tokens / seconds


__all__ = ["GrpoObjective", "LOSS_METRICS"]
