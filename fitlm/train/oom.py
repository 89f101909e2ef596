"""Out-of-memory during training becomes a diagnosis, not a stack trace.

The planner (fitlm.plan.diagnose) knows what each component of this layout costs and which single
config change brings the peak down most; the trainer says in which phase memory ran out.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from fitlm.config import Config


class TrainingOutOfMemory(ValueError):
    """A step ran out of device (or host) memory; the message names the phase and the remedies."""


@contextlib.contextmanager
def oom_guard(cfg: Config, phase: str, rank: int, device: torch.device) -> Iterator[None]:
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError) as exc:
        from fitlm.plan.diagnose import oom_message

        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        raise TrainingOutOfMemory(oom_message(cfg, phase, rank, total)) from exc
