"""Chunked output layer + cross-entropy (memory.loss_chunk_size), installed on an unmodified model.

The model's forward gains a `labels=` path that returns the summed loss computed from the final hidden
states and the output-layer weight in chunks (fitlm.models.loss.chunked_cross_entropy_sum). It runs
*inside* forward so that FSDP2 has the output weight gathered and reduces its gradient as usual.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from fitlm.models.loss import chunked_cross_entropy_sum


def apply_chunked_loss(model: nn.Module, chunk_size: int, compiled: bool = False) -> nn.Module:
    """`compiled` (memory.compile): each chunk's softmax/gradient arithmetic is fused by torch.compile, in
    the model's own graph when the whole model is compiled (fitlm.memory.compile)."""
    if not chunk_size:
        return model
    inner = model.forward

    @functools.wraps(inner)
    def forward(input_ids, *args, labels=None, **kwargs):
        if labels is None:
            return inner(input_ids, *args, **kwargs)
        hidden = model.hidden_states(input_ids, *args, **kwargs)  # [B,T,C]
        return chunked_cross_entropy_sum(hidden, model.output_layer.weight, labels, chunk_size, compiled)

    model.forward = forward
    return model
