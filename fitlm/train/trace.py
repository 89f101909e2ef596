"""Opt-in deep looks at a run: a torch profiler trace of a step window (`train.observe.profile_steps`) and,
on CUDA, an allocator snapshot when memory runs out (`train.observe.oom_snapshot`).

The trace is a Chrome trace per rank, `output_dir/profile/trace_rank{R}.json`: open it in
chrome://tracing or https://ui.perfetto.dev. The snapshot, `output_dir/memory_snapshot_rank{R}.pickle`,
holds every live allocation with the Python stack that made it; drag it onto
https://pytorch.org/memory_viz. Recording allocator history costs some speed, hence opt-in.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

import torch


class ProfileWindow:
    """Runs the torch profiler from step `first` through step `last` (inclusive)."""

    def __init__(self, steps: list[int] | None, out_dir: Path, rank: int, device: torch.device):
        self.first, self.last = steps if steps else (0, -1)
        self.path = out_dir / "profile" / f"trace_rank{rank}.json"
        self.device = device
        self.profiler: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.__enter__()
        yield
        if self.profiler is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends inside the window)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        print(f"fitlm: profiler trace of steps {self.first}-{self.last} written to {self.path}", file=sys.stderr)


class OOMSnapshot:
    """CUDA only: keep the allocator's history and dump it when an out-of-memory error passes."""

    def __init__(self, enabled: bool, out_dir: Path, rank: int, device: torch.device):
        self.enabled = enabled and device.type == "cuda"
        self.path = out_dir / f"memory_snapshot_rank{rank}.pickle"
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @contextlib.contextmanager
    def on_oom(self) -> Iterator[None]:
        try:
            yield
        except torch.OutOfMemoryError:
            if self.enabled:
                torch.cuda.memory._dump_snapshot(str(self.path))
                print(
                    f"fitlm: CUDA memory snapshot written to {self.path} (open it at pytorch.org/memory_viz)",
                    file=sys.stderr,
                )
            raise
