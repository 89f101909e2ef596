"""torch.compile applied per transformer block (memory.compile), from outside the model.

Blocks are compiled one by one rather than the whole model: every block has the same code, so one
compiled graph serves them all, graph breaks stay local, and FSDP2 can still wrap each block.
`nn.Module.compile` compiles in place, so parameter names (checkpoints, HF conversion) do not change.
"""

from __future__ import annotations

import torch.nn as nn

from fitlm.memory.recompute import transformer_blocks


def apply_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """Apply after tensor parallel, precision and recompute, before data parallel (torchtitan's order)."""
    if not enabled:
        return model
    for block in transformer_blocks(model):
        block.compile(dynamic=False)
    return model
