"""Activation recompute applied to the model's blocks from outside, never written into model code."""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of any registered family (`model.layers`, a ModuleDict or ModuleList), in order."""
    container = getattr(getattr(model, "model", model), "layers", None)
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    if isinstance(container, nn.ModuleList):
        return list(container)
    raise TypeError(f"{type(model).__name__} has no model.layers of blocks")


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """`full`: keep only each block's input and recompute the block during backward.

    The block's bound forward is wrapped in place (instead of wrapping the module) so parameter
    names, and with them checkpoints and HF conversion, stay exactly as they were.
    """
    if mode == "none":
        return model
    if mode != "full":
        raise ValueError(f"memory.recompute={mode!r} is not available yet; use none or full")
    for block in transformer_blocks(model):
        inner = block.forward

        @functools.wraps(inner)
        def recomputed(*args, _inner=inner, **kwargs):
            if kwargs.get("kv_cache") is not None:  # generation: nothing to save memory for
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = recomputed
    return model
