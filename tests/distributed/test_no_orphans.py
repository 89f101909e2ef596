"""No rank outlives its launcher: SIGKILL of a 2-rank `fitlm train` (its process group, or the launcher alone).

torchrun starts each worker in a session of its own, so a signal to the launcher's group never reaches
the ranks by itself (fitlm.parallel.lifetime). After the kill no process of the run is alive 15 s
later, the run's files stop changing and the latest checkpoint is complete.
While the run is alive, a second launcher into the same output_dir is refused naming the live run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitlm.checkpoint.store import latest_checkpoint, read_meta
from tests.e2e.helpers import tiny_config, write_config


def run_pids(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (the run's unique config path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().split(") ")[-1][:1]
            except OSError:
                continue
            if marker in cmd and state != "Z":  # a zombie is dead, only not yet reaped by its parent
                pids.append(int(entry.name))
    return pids


def files(out: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()}


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start(tiny_corpus, root: Path) -> tuple[subprocess.Popen, Path, Path]:
    out = root / "run"
    cfg = tiny_config(
        tiny_corpus,
        out,
        parallel={"data_parallel": 2},
        checkpoint={"interval": 2},
        train={"max_steps": 100000, "eval_interval": 0, "micro_batch_size": 2, "observe": {"tensorboard": False}},
    )
    path = write_config(root / "orphan-check.yaml", cfg)
    # A session of its own, as a terminal job or a job manager's child would be: killpg reaches exactly it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "fitlm.cli", "train", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for(lambda: latest_checkpoint(out) is not None or proc.poll() is not None, 180, "the first checkpoint")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return proc, out, path


def assert_all_gone_and_quiet(out: Path, marker: str) -> None:
    killed = time.monotonic()
    try:
        wait_for(lambda: not run_pids(marker), 15, "every process of the run to end")
    finally:
        for pid in run_pids(marker):  # never leave a process behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - killed < 15
    before = files(out)
    time.sleep(1.5)
    assert files(out) == before, "the run's files still change after its processes ended"
    read_meta(latest_checkpoint(out))  # the latest visible checkpoint is complete


@pytest.mark.parametrize("target", ["process group", "launcher only"])
def test_sigkill_leaves_no_rank_running(tiny_corpus, tmp_path, target):
    proc, out, cfg = start(tiny_corpus, tmp_path)
    marker = str(cfg)
    try:
        if target == "process group":
            # While it runs, a second launcher into the same directory is refused, naming the live run.
            second = subprocess.run(
                [sys.executable, "-m", "fitlm.cli", "train", marker], capture_output=True, text=True, timeout=120
            )
            assert second.returncode == 2, second.stderr
            assert f"pid {proc.pid}" in second.stderr and "in use by a live run" in second.stderr
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)  # the torchrun agent and the ranks are left without their launcher
        proc.wait(timeout=30)
        assert_all_gone_and_quiet(out, marker)
    finally:
        for pid in run_pids(marker):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_to_the_launcher_checkpoints_every_rank_and_exits_143(tiny_corpus, tmp_path):
    """SIGTERM reaches the ranks through the launcher (it forwards, then waits): the ranks agree to stop, save
    a checkpoint at the end of the step (async saves on, so a pending one is published first), exit 143."""
    out = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus,
        out,
        parallel={"data_parallel": 2},
        checkpoint={"interval": 3, "async_save": True},
        train={"max_steps": 100000, "eval_interval": 0, "micro_batch_size": 2, "observe": {"tensorboard": False}},
    )
    path = write_config(tmp_path / "sigterm-check.yaml", cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fitlm.cli", "train", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: latest_checkpoint(out) is not None or proc.poll() is not None, 180, "the first checkpoint")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)  # the launcher only, as `kill PID` would
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, err[-3000:]
        last = latest_checkpoint(out)
        step = read_meta(last)["step"]  # complete: the checkpoint the stop made is the latest
        assert f"stopped by SIGTERM after step {step}; checkpoint {last} is complete" in err
        assert "Traceback" not in err  # torchrun's SignalException is an ending, not a crash
        assert not run_pids(str(path))
    finally:
        for pid in run_pids(str(path)):
            os.kill(pid, signal.SIGKILL)
