"""Measured memory: peak live tensor bytes by category, on any device, CPU included.

RSS on CPU (and even CUDA's reserved bytes) mix in the allocator's caching and the runtime; what a
memory option changes is the bytes held by live tensors. torch's MemTracker follows every tensor's
storage from creation to release (a dispatch mode plus weak references) and files it as parameter,
gradient, optimizer state, activation or temporary. We take the snapshot at the step's peak.

`track_step` also returns what each module's forward left alive and how far its backward rose
(MemTracker's per-module snapshots), which `fitlm profile` lists as the top memory consumers.
A root module that runs several times in one step (gradient accumulation, pipeline micro batches)
is followed across its calls instead of being refused as MemTracker does by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

TOTAL = "Total"  # MemTracker's key for the sum over categories


class _NoHandle:
    def remove(self) -> None:
        pass


CATEGORIES = {
    "PARAM": "params",
    "BUFFER": "buffers",
    "GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations",
    "TEMP": "temporaries",
    "OTH": "other",
}


def plan_components(cats: dict[str, int]) -> dict[str, int]:
    """These categories (CATEGORIES' names, and "total") -> the planner's components. A storage tracker
    cannot tell logits from other activations: they are inside `activations` (and `logits` is 0)."""
    return {
        "params": cats["params"],
        "grads": cats["grads"],
        "optimizer": cats["optimizer"],
        "activations": cats["activations"] + cats["temporaries"],
        "logits": 0,
        "other": cats["buffers"] + cats["other"],
        "total": cats["total"],
    }


class _StepTracker(MemTracker):
    """MemTracker that follows a root module called several times in one step (accumulation, pipeline
    micro batches) as it does a submodule used twice, instead of raising NotImplementedError."""

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # raised before MemTracker changed any state: record the repeat call
            stats = self.memory_tracking[module]
            stats.input_mem = self._track_inputs_or_outputs(inputs)
            snapshot = self.get_tracker_snapshot()
            stats.local_peak = {dev: snap[TOTAL] for dev, snap in snapshot.items()}
            stats.snapshots.setdefault(_ModState.PEAK_FW, []).append(snapshot)
            stats.snapshots.setdefault(_ModState.PRE_FW, []).append(self.get_tracker_snapshot())

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient, which torch refuses for frozen ones (LoRA, freeze):
        # mark those as already hooked, with handles whose removal does nothing. Checked at every module
        # entry, not once: FSDP2 swaps in new unsharded parameter objects at each ZeRO-3 gather.
        for p in module.parameters():
            if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def restart_peak(self) -> None:
        """Start the peak again from the live bytes now, as entering the tracker does."""
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap[TOTAL] for dev, snap in self._peak_mem_snap.items()}


def tracker_for(modules: list[nn.Module], optimizer: torch.optim.Optimizer | None) -> _StepTracker:
    """A MemTracker that files `modules`' parameters and `optimizer`'s states, frozen parameters included."""
    tracker = _StepTracker()
    for module in modules:  # frozen parameters first (see _track_module_params_and_buffers)
        for p in module.parameters():
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
    tracker.track_external(*modules, *([optimizer] if optimizer is not None else []))
    return tracker


@dataclass
class StepMemory:
    """One measured step: peak bytes by category (plus `total`), summed over devices, and per module."""

    peak: dict[str, int]
    modules: list[dict] = field(default_factory=list)  # see module_rows


def peak_live_bytes(
    step: Callable[[], object], modules: list[nn.Module], optimizer: torch.optim.Optimizer | None, warmup_steps: int = 1
) -> dict[str, int]:
    """Run `step` `warmup_steps` times (optimizer states appear in the first step), then once more
    measured; returns peak bytes by category plus `total`, summed over devices."""
    return track_step(step, modules, optimizer, warmup_steps).peak


def track_step(
    step: Callable[[], object],
    modules: list[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    warmup_steps: int = 1,
    measured_steps: int = 1,
) -> StepMemory:
    """`peak_live_bytes` with the per-module rows of the measured step. With `measured_steps` > 1 each of
    those steps is measured on its own and the least peak kept (see `measured_steps_for`)."""
    tracker = tracker_for(modules, optimizer)
    best: StepMemory | None = None
    with tracker:
        for _ in range(warmup_steps):
            step()
            tracker.reset_mod_stats()  # MemTracker keeps per-module stats of one iteration only
        for _ in range(measured_steps):
            tracker.reset_mod_stats()
            tracker.restart_peak()
            step()
            measured = StepMemory(peak_by_category(tracker), module_rows(tracker))
            if best is None or measured.peak["total"] < best.peak["total"]:
                best = measured
    assert best is not None, "measured_steps must be at least 1"
    return best


def measured_steps_for(distributed: bool, device: torch.device) -> int:
    """Steps to measure: one, or three under gloo. Gloo's worker thread drops its reference to a finished
    collective's buffers a moment after the rank has moved on, so now and then a buffer the step already freed is
    still counted at the next allocation (about one step in ten on an idle machine, more on a busy one). The
    least of three steps is the step's own peak; NCCL and one process have no such lag."""
    return 3 if distributed and device.type == "cpu" else 1


def peak_by_category(tracker: MemTracker) -> dict[str, int]:
    """The tracker's peak bytes by category (CATEGORIES' names, plus `total`), summed over devices."""
    out = {name: 0 for name in CATEGORIES.values()} | {"total": 0}
    for per_device in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in per_device.items():
            key = CATEGORIES.get(str(kind).rsplit(".", 1)[-1])
            if key:
                out[key] += int(nbytes)
            elif kind == TOTAL:
                out["total"] += int(nbytes)
    return out


def _rise(stats, before: _ModState, after: _ModState) -> int:
    """Bytes between two of a module's snapshots (its last call), summed over devices; 0 if either is missing."""
    a, b = stats.snapshots.get(before), stats.snapshots.get(after)
    if not a or not b:
        return 0
    return sum(snap.get(TOTAL, 0) for snap in b[-1].values()) - sum(snap.get(TOTAL, 0) for snap in a[-1].values())


def module_rows(tracker: MemTracker) -> list[dict]:
    """Per module of the measured step: `params` (bytes of its own and its children's parameters),
    `forward_kept` (bytes its forward left alive: saved activations and output, last call),
    `forward_peak` and `backward_peak` (how far live bytes rose above the start of its forward /
    backward). A module includes its children."""
    rows = []
    for stats in tracker.memory_tracking.values():
        rows.append(
            {
                "module": stats.mod_fqn,
                "params": int(getattr(stats, "parameter_mem", 0)),
                "forward_kept": _rise(stats, _ModState.PRE_FW, _ModState.POST_FW),
                "forward_peak": _rise(stats, _ModState.PRE_FW, _ModState.PEAK_FW),
                "backward_peak": _rise(stats, _ModState.PRE_BW, _ModState.PEAK_BW),
            }
        )
    return rows
