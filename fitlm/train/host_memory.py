"""Each rank's peak host memory (resident set) per phase of a run: load, step, save.

Why: building, loading and saving are where a rank's host memory peaks on large models (the
device's allocator peak says nothing about them). `fitlm plan` predicts these three; the run writes
what happened to output_dir/host_memory.json, one figure per rank and phase, so the two can be read
side by side (bench/scale.py does).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from fitlm.atomic import atomic_file
from fitlm.hardware import host_peak_rss, reset_host_peak
from fitlm.parallel.mesh import ParallelContext

FILE = "host_memory.json"


class HostMemory:
    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx
        self.peaks: dict[str, int] = {}

    def mark(self, phase: str) -> None:
        """The peak since the previous mark (or process start) belongs to `phase`; start the next one."""
        self.peaks[phase] = host_peak_rss()
        reset_host_peak()

    def write(self, output_dir: Path) -> None:
        """Gather every rank's peaks (collective) and write them on rank 0: {phase: [bytes per rank]}."""
        mine = dict(self.peaks)
        if self.ctx.distributed:
            everyone: list = [None] * self.ctx.world_size
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        if self.ctx.is_main:
            out = {phase: [r.get(phase) for r in everyone] for phase in mine}
            with atomic_file(Path(output_dir) / FILE) as tmp:
                tmp.write_text(json.dumps(out, indent=1) + "\n")
