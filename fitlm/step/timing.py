"""Wall time per phase of a training step (data wait, forward, backward, optimizer, ...).

Cheap enough to stay on in every run: two `perf_counter` calls per phase. On CUDA, kernels run
asynchronously, so `sync=True` (used by `fitlm profile`) waits for the device at each phase boundary;
without it a phase's time is the time to enqueue its work.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch


class PhaseTimer:
    def __init__(self, device: torch.device, sync: bool = False):
        self.device = device
        self.sync = sync and device.type == "cuda"
        self._totals: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._wait()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._wait()
            self._totals[phase] += time.perf_counter() - start

    def _wait(self) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)

    def pop(self) -> dict[str, float]:
        """Seconds per phase since the last pop (a phase entered several times is summed)."""
        totals, self._totals = dict(self._totals), defaultdict(float)
        return totals
