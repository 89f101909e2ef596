"""A rank that stops responding (SIGSTOP) makes the others fail after parallel.timeout_s, naming it and its phase.

The first test runs the real CLI (torchrun, gloo, CPU); torchrun then waits its fixed 30 s for the stopped rank
to honour SIGTERM before it SIGKILLs it, which puts the test in the slow tier. The second test drives the same
path, gloo's own timeout error through `Heartbeat.on_timeout`, in two bare processes within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fitlm.train.heartbeat import PHASES, Heartbeat, RankTimeoutError
from tests.distributed.spawn import free_port
from tests.e2e.helpers import tiny_config, write_config

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")


def processes_of(cfg_path: Path) -> dict[str, int]:
    """pid of every process whose command line names `cfg_path` (launcher, torchrun agent, ranks), by RANK ('' when unset)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if str(cfg_path).encode() not in cmdline:
            continue
        rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), "")
        found[rank if rank not in found else f"{rank}/{entry}"] = int(entry)
    return found


def kill_all(pids) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.slow  # ~55 s: start-up, parallel.timeout_s (10 s), then torchrun's 30 s grace for the stopped rank
def test_a_stopped_rank_fails_the_run_naming_it_and_its_phase(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus,
        out,
        parallel={"data_parallel": 2, "timeout_s": 10},
        train={"max_steps": 100000, "eval_interval": 0, "peak_tflops": 1.0, "observe": {"tensorboard": False}},
    )
    cfg_path = write_config(tmp_path / "c.yaml", cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fitlm.cli", "train", str(cfg_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 180
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):  # training is underway
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no metrics record within 180 s"
            time.sleep(0.2)
        pids = processes_of(cfg_path)
        assert {"0", "1"} <= pids.keys(), pids
        os.kill(pids["1"], signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        kill_all([*pids.values(), proc.pid])
        proc.wait()
    error = next((line for line in stderr.splitlines() if "fitlm train: error:" in line), None)
    assert error is not None, stderr[-4000:]
    assert proc.returncode != 0 and took < 60, (proc.returncode, took)
    assert "rank 1 stopped responding" in error and "parallel.timeout_s = 10 s" in error, error
    assert any(f"in {phase} of step" in error for phase in PHASES), error
    print(f"\nexit {took:.1f} s after SIGSTOP: {error}")


def stop_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=4))
    hb = Heartbeat(dist.distributed_c10d._get_default_store(), rank, 2, 4)
    dist.barrier()
    if rank == 1:
        hb.mark("data loading", 1)
        os.kill(os.getpid(), signal.SIGSTOP)  # the test SIGKILLs it
    hb.mark("forward/backward", 1)
    start = time.monotonic()
    try:
        with hb.on_timeout():
            dist.all_reduce(torch.ones(2))
        message = "no error"
    except RankTimeoutError as e:
        message = f"{time.monotonic() - start:.1f} {e}"
    Path(out_dir, "rank0.txt").write_text(message)
    os._exit(0)  # the group is broken: no teardown


def test_gloo_timeout_becomes_a_diagnosis_naming_the_stopped_rank(tmp_path):
    mp.get_context("forkserver").set_forkserver_preload([__name__])
    ctx = mp.start_processes(
        stop_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="forkserver"
    )
    try:
        ctx.processes[0].join(timeout=60)
        assert not ctx.processes[0].is_alive(), "rank 0 did not give up"
    finally:
        kill_all([p.pid for p in ctx.processes if p.pid])
        for p in ctx.processes:
            p.join(5)
    waited, message = (tmp_path / "rank0.txt").read_text().split(" ", 1)
    assert 3.5 < float(waited) < 10, waited
    assert message.startswith(
        "a collective on rank 0 waited longer than parallel.timeout_s = 4 s in forward/backward "
        "of step 1 (gloo: Timed out waiting 4000ms for recv operation to complete)."
    ), message
    assert "rank 1 stopped responding: its last heartbeat is" in message and "in data loading of step 1" in message
