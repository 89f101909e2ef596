"""Measured memory: peak live tensor bytes by category, on any device, CPU included.

RSS on CPU (and even CUDA's reserved bytes) mix in the allocator's caching and the runtime; what a
memory option changes is the bytes held by live tensors. torch's MemTracker follows every tensor's
storage from creation to release (a dispatch mode plus weak references) and files it as parameter,
gradient, optimizer state, activation or temporary. We take the snapshot at the step's peak.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

class _NoHandle:
    def remove(self) -> None:
        pass


CATEGORIES = {"PARAM": "params", "BUFFER": "buffers", "GRAD": "grads", "OPT": "optimizer", "ACT": "activations",
              "TEMP": "temporaries", "OTH": "other"}


def peak_live_bytes(step: Callable[[], object], modules: list[nn.Module], optimizer: torch.optim.Optimizer | None,
                    warmup_steps: int = 1) -> dict[str, int]:
    """Run `step` `warmup_steps` times (optimizer states appear in the first step), then once more
    measured; returns peak bytes by category plus `total`, summed over devices."""
    tracker = MemTracker()
    tracker.track_external(*modules, *([optimizer] if optimizer is not None else []))
    # MemTracker hooks every parameter's gradient, which torch refuses for frozen ones (LoRA, freeze):
    # mark those as already hooked, with handles whose removal does nothing.
    for module in modules:
        for p in module.parameters():
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
    with tracker:
        for _ in range(warmup_steps):
            step()
            tracker.reset_mod_stats()  # MemTracker keeps per-module stats of one iteration only
        step()
    peak = tracker.get_tracker_snapshot("peak")
    out = {name: 0 for name in CATEGORIES.values()} | {"total": 0}
    for per_device in peak.values():
        for kind, nbytes in per_device.items():
            key = CATEGORIES.get(str(kind).rsplit(".", 1)[-1])
            if key:
                out[key] += int(nbytes)
            elif kind == "Total":
                out["total"] += int(nbytes)
    return out
