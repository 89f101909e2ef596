"""Start the processes a layout needs: `fitlm train` re-runs itself under torchrun on this node.

Under an existing torchrun (multi-node, Slurm) nothing is spawned: each process joins the job.
"""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    # --standalone: a private rendezvous on localhost, so several jobs on one machine never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "fitlm.cli", *argv]


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `fitlm <argv>` in `nproc` processes on this machine; returns torchrun's exit status."""
    env = dict(os.environ)
    # Share the cores between ranks instead of torchrun's default of one thread per rank.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(torchrun_command(nproc, argv), env=env)
