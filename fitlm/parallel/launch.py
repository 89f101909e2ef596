"""Start the processes a layout needs: `fitlm train` re-runs itself under torchrun on this node.

Under an existing torchrun (multi-node, Slurm) nothing is spawned: each process joins the job.
With `max_restarts` torchrun restarts every process when one fails (up to that many times); the
restarted trainer resumes from the latest complete checkpoint (checkpoint.resume: auto).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Callable

from fitlm.parallel.collective_trace import TRACE_ENV, read_reports
from fitlm.parallel.lifetime import LAUNCHER_PID


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
    # fitlm.parallel.lifetime is torchrun that also stops when the launcher dies (no orphan ranks).
    return [
        sys.executable,
        "-m",
        "fitlm.parallel.lifetime",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *restarts,
        "-m",
        "fitlm.cli",
        *without_nproc(argv),
    ]


def launch_local(
    nproc: int,
    argv: list[str],
    max_restarts: int = 0,
    extra_env: dict[str, str] | None = None,
    on_abandon: Callable[[], str] | None = None,
) -> int:
    """Run `fitlm <argv>` in `nproc` processes on this machine; returns torchrun's exit status.

    `on_abandon`: what is on disk, in words, for the line a second SIGTERM / Ctrl-C prints (see `Forwarder`)."""
    env = dict(os.environ, **(extra_env or {}))
    # Share the cores between ranks instead of torchrun's default of one thread per rank.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts > 0:
        # torchrun's rendezvous store outlives a failed attempt and keeps its keys, so a restarted rank can
        # read the dead process's address and fail to connect; a store per attempt avoids the race.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env[LAUNCHER_PID] = str(os.getpid())
    trace = tempfile.mkdtemp(prefix="fitlm-collectives-")  # each rank's current collective (collective_trace)
    env[TRACE_ENV] = trace
    # A session of its own: a terminal's Ctrl-C reaches the launcher only, which forwards it exactly once (the
    # agent and the launcher both passing it on would be a second signal to the ranks: a stop without a save).
    agent = subprocess.Popen(torchrun_command(nproc, argv, max_restarts), env=env, start_new_session=True)
    forwarder = Forwarder(agent, on_abandon)
    previous = {s: signal.signal(s, forwarder) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        rc = wait_waking(agent)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    report_collectives(trace, nproc, rc)
    return 128 + forwarder.abandoned if forwarder.abandoned else rc


def wait_waking(proc: subprocess.Popen, every_s: float = 0.2) -> int:
    """`proc.wait()` that lets this process's signal handlers run while it waits. A signal the kernel hands to
    another thread (torch's, the run lock's) only flags it for the main thread, which a blocking waitpid leaves
    asleep: the launcher would never pass a Ctrl-C on. Polling returns to Python every `every_s` seconds."""
    while True:
        try:
            return proc.wait(timeout=every_s)
        except subprocess.TimeoutExpired:
            continue


class Forwarder:
    """The launcher's SIGTERM / Ctrl-C / SIGHUP handler. The first signal goes on to the agent (SIGHUP as SIGTERM),
    which passes it to the ranks: they save at the end of the step and exit 128 + it, and so does torchrun
    (fitlm.parallel.lifetime). A second one stops at once: SIGKILL to the agent, whose ranks die with it."""

    def __init__(self, agent: subprocess.Popen, on_abandon: Callable[[], str] | None):
        self.agent, self.on_abandon = agent, on_abandon
        self.first: int | None = None
        self.abandoned = 0  # the second signal's number, once it came

    def __call__(self, signum: int, frame) -> None:
        if self.agent.poll() is not None:
            return
        if self.first is None:
            self.first = signum
            self.agent.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
            return
        self.abandoned = signum
        self.agent.kill()  # (no wait here: the main thread may be inside agent.wait(), holding its lock)
        from fitlm.cli_common import say, signal_name

        state = f"; {self.on_abandon()} (an unfinished save is removed at the next start)" if self.on_abandon else ""
        name = signal_name(signum)
        say(f"fitlm: second signal ({name}): every rank was stopped at once, the save was abandoned{state}")


def report_collectives(trace: str, nproc: int, rc: int) -> None:
    """After a failed job, say which collective each dead rank was inside (torchrun only gives the signal)."""
    lines = read_reports(trace, nproc) if rc != 0 else []
    if lines:
        print(
            "fitlm: the job failed while these ranks were inside a collective (a rank that aborts there usually "
            "disagrees with its peers on the tensor's shape or on the order of collectives):\n  " + "\n  ".join(lines),
            file=sys.stderr,
        )
    else:
        shutil.rmtree(trace, ignore_errors=True)


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 on the first attempt or outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
