"""Deterministic fault injection for the crash-recovery tests: `FITLM_FAULT=<where>:<step>:<rank>`.

`where` is `step` (end of that optimizer step, before any save) or `save` (this rank's checkpoint
shards are written, the checkpoint is not yet complete). The process SIGKILLs itself, as `kill -9`
would, on the first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT is 0), so the restarted
job runs through. Unset, this costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal


def maybe_die(where: str, step: int, rank: int) -> None:
    spec = os.environ.get("FITLM_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    w, s, r = spec.split(":")
    if w == where and int(s) == step and int(r) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
