"""No process of a run outlives the one that started it.

torchrun starts every worker in a session of its own, so a signal to the launcher's process group
(a closed terminal, a job manager's SIGKILL) never reaches the ranks: they would finish the run as
orphans, holding memory and writing into output_dir. Two links close that gap (Linux prctl
PR_SET_PDEATHSIG, set by each process on itself right after it starts):

    fitlm train (launcher) ──► torchrun agent ──► rank 0, rank 1, ...
      launcher dies: the agent gets SIGTERM, which torchrun forwards to the ranks (checkpoint, exit 143)
      agent dies:    every rank gets SIGKILL (nobody is left to coordinate a checkpoint)

`python -m fitlm.parallel.lifetime TORCHRUN-ARGS` is torchrun with the first link set.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from fitlm.faults import LAUNCHER_PID  # set by the launcher for its agent: the parent it must still have

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits; False where unsupported.

    If the parent is already gone (it died between our fork and this call), act now instead of never.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = os.getppid()
    if parent == 1 or (expected_parent is not None and parent != expected_parent):
        os.kill(os.getpid(), sig)
    return True


def main() -> None:
    expected = int(os.environ[LAUNCHER_PID]) if os.environ.get(LAUNCHER_PID, "").isdigit() else None
    die_with_parent(signal.SIGTERM, expected)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    sys.argv = ["torchrun", *sys.argv[1:]]
    try:
        torchrun()
    except SignalException as exc:
        # torchrun has already passed the signal to the ranks and waited for them (SIGTERM: each saved a
        # checkpoint); end as a process killed by it would, 128 + N (143), not with torchrun's traceback.
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
