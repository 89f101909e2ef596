"""Token-summed cross-entropy, so that accumulation can divide by the tokens of the whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token losses over labels != -100, computed in fp32.

    logits: [B, T, V] in any dtype; labels: [B, T].

    Tensor-parallel logits (a DTensor sharded on V) must be passed inside
    `fitlm.parallel.tensor_parallel.loss_context(model)`, and the `.backward()` run there too: the
    loss is then computed on the vocab shards. The result is always a plain tensor, equal on every rank.
    """
    try:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    except RuntimeError as e:
        if isinstance(logits, DTensor) and "mixed torch.Tensor and DTensor" in str(e):
            raise RuntimeError("cross_entropy_sum got vocab-sharded tensor-parallel logits outside loss_parallel: "
                               "compute the loss and call .backward() inside "
                               "fitlm.parallel.tensor_parallel.loss_context(model)") from e
        raise
    # Differentiable DTensor -> plain tensor, so callers can add, log and backprop it as usual.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def count_targets(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())
