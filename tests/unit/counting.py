"""Counting helpers shared by tests."""

from __future__ import annotations

from torch import nn


def trainable_parameter_count(model: nn.Module) -> int:
    """Trainable parameters, a tied one once."""
    seen: set[int] = set()
    return sum(p.numel() for p in model.parameters() if p.requires_grad and not (id(p) in seen or seen.add(id(p))))
