"""Token-summed cross-entropy, so that accumulation can divide by the tokens of the whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token losses over labels != -100, computed in fp32.

    logits: [B, T, V] in any dtype; labels: [B, T].
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def count_targets(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())
