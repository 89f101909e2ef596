"""torch.compile (memory.compile) applied from outside the model: the whole model where the layout
allows it, else block by block.

Whole model: one graph from token ids to the summed loss. `nn.Module.compile` compiles the module's
call, which runs whatever `forward` the module has when it is called, so the chunked loss installed
after this (fitlm.memory.chunked_loss) is traced too: the embedding, the final norm, the casts between
blocks and the loss's own arithmetic fuse with the blocks' kernels instead of running eagerly between
per-block graphs.

Per block, wherever a layout wraps or splits the model after compile: FSDP2 shards every block (its
hooks gather one block's parameters at a time), recompute checkpoints every block, tensor parallel's
parameters are DTensors and a pipeline stage is a slice of the blocks. Every block has the same code,
so one compiled graph serves them all and a graph break stays local to its block.

Both compile in place, so parameter names (checkpoints, HF conversion) do not change.
"""

from __future__ import annotations

import torch.nn as nn

from fitlm.config import MemoryConfig
from fitlm.memory.recompute import transformer_blocks
from fitlm.parallel_dims import ParallelDims


def compiles_whole_model(memory: MemoryConfig, dims: ParallelDims) -> bool:
    """Whether memory.compile takes the whole model (one process, DDP, ZeRO-1) rather than each block:
    only where nothing wraps or splits blocks after compile (no FSDP2, recompute, tensor or pipeline parallel)
    and no activation offload, whose hooks need a block's saved tensors back one block at a time (a whole
    compiled backward unpacks every saved tensor at once)."""
    return (
        memory.compile
        and memory.recompute == "none"
        and not dims.fsdp_sharded
        and dims.tp == 1
        and dims.pp == 1
        and memory.activation_offload is False
    )


def apply_compile(
    model: nn.Module, memory: MemoryConfig, dims: ParallelDims | None = None, backend="inductor"
) -> nn.Module:
    """Apply after tensor parallel, precision and recompute, before the chunked loss and data parallel
    (torchtitan's order). `dims`: this rank's layout, which decides the scope (`compiles_whole_model`);
    None compiles per block, for a caller that wraps the blocks itself. `backend`: torch.compile's (the
    tests pass one that records the graphs)."""
    if not memory.compile:
        return model
    whole = dims is not None and compiles_whole_model(memory, dims)
    for module in [model] if whole else transformer_blocks(model):
        module.compile(dynamic=False, backend=backend)
    return model


def compiled_whole(model: nn.Module) -> bool:
    """Whether `model` itself was compiled (`nn.Module.compile`), so what its forward runs is traced into its graph."""
    return getattr(model, "_compiled_call_impl", None) is not None
