"""Deterministic fault injection for the crash-recovery tests: `FITLM_FAULT=<where>:<step>:<rank>`.

`where` is `step` (end of that optimizer step, before any save), `save` (this rank's checkpoint
shards are written, the checkpoint is not yet complete) or `final` (the final model's weights are
written into its temporary directory, not yet renamed into place; `step` is ignored there).
A numeric `rank` SIGKILLs that rank alone, as `kill -9` would, on the first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT is 0), so a restarted job runs through. `rank` = `all` is a power loss:
rank 0 SIGKILLs the launcher's process group, the torchrun agent (every rank then dies with its agent,
fitlm.parallel.lifetime) and itself, all at once. Unset, this costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

LAUNCHER_PID = "FITLM_LAUNCHER_PID"  # fitlm.parallel.lifetime sets it for the agent; the ranks inherit it


def maybe_die(where: str, step: int, rank: int) -> None:
    spec = os.environ.get("FITLM_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    w, s, r = spec.split(":")
    if w != where or (where != "final" and int(s) != step):
        return
    if r == "all" and rank == 0:
        power_loss()
    elif r != "all" and int(r) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def power_loss() -> None:
    """SIGKILL every process of this run at once: the launcher's process group, the torchrun agent (this rank's
    parent, in a session of its own: fitlm.parallel.launch), then this process."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    if launcher.isdigit():
        for kill in (
            lambda: os.killpg(os.getpgid(int(launcher)), signal.SIGKILL),
            lambda: os.kill(os.getppid(), signal.SIGKILL),
        ):
            try:
                kill()
            except ProcessLookupError:
                pass
    os.kill(os.getpid(), signal.SIGKILL)


def enabled() -> bool:
    return bool(os.environ.get("FITLM_FAULT"))
