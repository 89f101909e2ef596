"""Activation recompute applied to the model's blocks from outside, never written into model code."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of any registered family (`model.layers`, a ModuleDict or ModuleList), in order."""
    container = getattr(getattr(model, "model", model), "layers", None)
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    if isinstance(container, nn.ModuleList):
        return list(container)
    raise TypeError(f"{type(model).__name__} has no model.layers of blocks")


# Outputs worth keeping under selective recompute: matmuls and attention cost O(n·d²) or O(n²·d) to
# redo, while what lies between them (norms, SwiGLU, RoPE, residual adds, casts) is cheap element-wise
# work whose activations are the bulk of a block's saved memory.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_recompute(model: nn.Module, mode: str, every_n_layers: int = 1) -> nn.Module:
    """Recompute activations of every `every_n_layers`-th block in backward instead of keeping them.

    `full`: keep only the block's input and rerun the whole block. `selective`: keep matmul and
    attention outputs, rerun the element-wise ops between them (torch's selective checkpoint policy).
    The block's bound forward is wrapped in place (instead of wrapping the module) so parameter
    names, and with them checkpoints and HF conversion, stay exactly as they were.
    """
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"memory.recompute={mode!r}: use none, full or selective")
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
    for i, block in enumerate(transformer_blocks(model)):
        # Global block index (pipeline stages keep their global names), so every layout recomputes the same blocks.
        index = int(getattr(block, "layer_idx", i))
        if index % every_n_layers:
            continue
        inner = block.forward

        @functools.wraps(inner)
        def recomputed(*args, _inner=inner, **kwargs):
            if kwargs.get("kv_cache") is not None:  # generation: nothing to save memory for
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = recomputed
    return model
