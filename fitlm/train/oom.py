"""Out-of-memory during training becomes a diagnosis, not a stack trace.

The planner (fitlm.plan.diagnose) knows what each component of this layout costs and which single
config change brings the peak down most; the trainer says in which phase memory ran out.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from fitlm.config import Config
from fitlm.plan.diagnose import oom_message

# Phases whose memory the layout plan does not describe (host memory, mostly) get their own first advice.
PHASE_ADVICE = {
    "data loading": (
        "data loading holds host memory: lower data.prefetch and data.num_workers, "
        "or cap sample length with data.max_length."
    ),
    "checkpoint save": (
        "saving gathers or copies state: turn off checkpoint.async_save (it keeps a host copy "
        "of every shard while writing), and make sure the host has room for one rank's "
        "shard; the final model directory is gathered on rank 0 in full."
    ),
}


class TrainingOutOfMemory(ValueError):
    """A step ran out of device (or host) memory; the message names the phase and the remedies."""


@contextlib.contextmanager
def oom_guard(cfg: Config, phase: str, rank: int, device: torch.device) -> Iterator[None]:
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError) as exc:
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        advice = PHASE_ADVICE.get(phase)
        message = oom_message(cfg, phase, rank, total)
        if advice:
            message = f"{message} First, for this phase: {advice}"
        raise TrainingOutOfMemory(f'{message} See docs/troubleshooting.md, section "Out of memory".') from exc
