"""Start the processes a layout needs: `fitlm train` re-runs itself under torchrun on this node.

Under an existing torchrun (multi-node, Slurm) nothing is spawned: each process joins the job.
With `max_restarts` torchrun restarts every process when one fails (up to that many times); the
restarted trainer resumes from the latest complete checkpoint (checkpoint.resume: auto).
"""

from __future__ import annotations

import os
import subprocess
import sys


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` less fitlm's `--nproc N` / `--nproc=N`: torchrun's parser reads it as an ambiguous abbreviation of
    its own --nproc-per-node (even after the script name) and refuses to start; under torchrun the world size
    comes from the environment anyway."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def torchrun_command(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    # --standalone: a private rendezvous on localhost, so several jobs on one machine never collide.
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts > 0 else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *restarts,
            "-m", "fitlm.cli", *without_nproc(argv)]


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `fitlm <argv>` in `nproc` processes on this machine; returns torchrun's exit status."""
    env = dict(os.environ)
    # Share the cores between ranks instead of torchrun's default of one thread per rank.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts > 0:
        # torchrun's rendezvous store outlives a failed attempt and keeps its keys, so a restarted rank can
        # read the dead process's address and fail to connect; a store per attempt avoids the race.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return subprocess.call(torchrun_command(nproc, argv, max_restarts), env=env)


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 on the first attempt or outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
