"""Supervised fine-tuning and pretraining (`finetune.objective: sft`): next-token cross-entropy on the target
tokens (labels other than -100), the step's loss a mean over all of the step's target tokens on all
data-parallel ranks. It logs nothing beside the loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fitlm.models.loss import count_targets

if TYPE_CHECKING:
    from fitlm.step.train_step import TrainStep


class SFTObjective:
    """Token cross-entropy through the step's own loss (`TrainStep.loss_sum`: whole logits, or the chunked
    head of memory.loss_chunk_size), weighted by target tokens."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @staticmethod
    def count(labels: torch.Tensor) -> int:
        return count_targets(labels)

    def micro_loss(
        self, step: TrainStep, input_ids: torch.Tensor, labels: torch.Tensor, doc: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss of the micro batch, no metric sums [0])."""
        return step.loss_sum(input_ids, labels, **doc), torch.zeros(0, device=step.device)

    def observe(self, means: torch.Tensor) -> None:
        """No metrics: `means` is empty."""


__all__ = ["SFTObjective"]
