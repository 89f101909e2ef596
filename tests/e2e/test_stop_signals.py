"""SIGTERM and Ctrl-C never lose a run silently (checkpoint.save_on_signal), through the real CLI in subprocesses.

The demo's command (configs/tiny.yaml: checkpoint.interval 0) on the demo data, the golden test's first 8 steps:
a signal once metrics.jsonl shows step 2 saves a final checkpoint at the end of the step and says so; the same
command again resumes from it and ends with the golden losses of an uninterrupted run. The opt-out says that
nothing was saved; a second signal stops at once. A dp2 launcher stopped by Ctrl-C to its process group or by
SIGTERM saves once and exits 130 / 143; a second signal to it stops every rank at once. Every wait polls a file
with a generous timeout: nothing depends on the machine's speed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitlm.checkpoint.store import list_checkpoints, read_meta
from tests.conftest import ROOT
from tests.distributed.test_no_orphans import run_pids
from tests.e2e.helpers import read_metrics, tiny_config, write_config

GOLDEN = Path(__file__).parent / "golden" / "tiny_config_20_steps.json"
WAIT_S = 300  # generous: a busy machine only takes longer
STEPS = 8


def demo_command(data: Path, out: Path, *overrides: str) -> list[str]:
    """`fitlm train configs/tiny.yaml` as test_demo_config.py's golden run, to step 8 (every step logged; steps
    1-8 lie inside the 30 warmup steps, so their learning rates, hence losses, are the golden run's)."""
    sets = [
        f"data.train={data / 'data' / 'train'}",
        f"data.valid={data / 'data' / 'valid'}",
        f"train.output_dir={out}",
        "train.progress=false",
        f"train.max_steps={STEPS}",
        "train.log_interval=1",
        "train.eval_interval=0",
        *overrides,
    ]
    return [sys.executable, "-m", "fitlm.cli", "train", str(ROOT / "configs" / "tiny.yaml")] + [
        x for s in sets for x in ("--set", s)
    ]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """The command in a session of its own (as a terminal job: killpg reaches exactly it), stderr to `log`."""
    with open(log, "w") as err:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def wait_for(cond, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if found := cond():
            return found
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")


def logged_step(out: Path) -> int:
    """The last step metrics.jsonl shows (0 before the first)."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = [json.loads(x)["step"] for x in lines if x.endswith("}")]
    return max(steps, default=0)


def signal_at_step_2(argv: list[str], out: Path, log: Path, *signals: int) -> tuple[int, str]:
    """Start, send `signals` to the process once step 2 is logged; (exit status, stderr)."""
    proc = start(argv, log)
    try:
        wait_for(lambda: logged_step(out) >= 2, "step 2 in metrics.jsonl", proc, log)
        for sig in signals:
            os.kill(proc.pid, sig)
        rc = proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, log.read_text()


def golden() -> list[float]:
    return json.loads(GOLDEN.read_text())["losses"]


def test_ctrl_c_saves_and_the_same_command_resumes_with_the_losses_of_an_uninterrupted_run(demo_data, tmp_path):
    out = tmp_path / "run"
    argv = demo_command(demo_data, out)
    rc, err = signal_at_step_2(argv, out, tmp_path / "first.log", signal.SIGINT)
    assert rc == 130, err[-3000:]
    (step, ckpt), *_ = list_checkpoints(out / "checkpoints")[::-1]
    assert 2 <= step < STEPS and read_meta(ckpt)["step"] == step  # complete, at the step the stop ended
    assert "SIGINT received: saving a checkpoint at the end of this step, then stopping" in err
    assert f"stopped by SIGINT after step {step}; checkpoint {ckpt} is complete" in err
    assert f"Run the same command again to resume from step {step}" in err
    assert logged_step(out) == step and not (out / "model").exists()

    again = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} (step {step}, saved on" in again.stderr
    assert f"resuming from step {step}" in again.stderr
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # steps 1..k once, then k+1.. resumed
    assert [r["loss"] for r in records] == pytest.approx(golden()[:STEPS], rel=2e-4, abs=2e-4)


def test_opting_out_says_nothing_was_saved_and_a_rerun_starts_over(demo_data, tmp_path):
    out = tmp_path / "run"
    argv = demo_command(demo_data, out, "checkpoint.save_on_signal=false")
    rc, err = signal_at_step_2(argv, out, tmp_path / "first.log", signal.SIGTERM)
    assert rc == 143, err[-3000:]
    assert "stopping at the end of this step without a checkpoint (checkpoint.save_on_signal: false)" in err
    step = logged_step(out)
    assert f"stopped by SIGTERM after step {step}; nothing was saved (checkpoint.save_on_signal is false" in err
    assert "no checkpoint is on disk, so running the same command again starts over from step 1" in err
    assert not list_checkpoints(out / "checkpoints")
    # A rerun (one step: max_steps may change on a rerun) says it starts over, instead of doing it silently.
    again = subprocess.run(argv + ["--set", "train.max_steps=1"], capture_output=True, text=True, timeout=WAIT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds no checkpoint of the run before: starting over from step 1" in again.stderr
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_a_second_signal_stops_at_once_saying_what_is_on_disk(demo_data, tmp_path):
    out = tmp_path / "run"
    # Two signals at once: Python runs both handlers before the step goes on (the lower number first), so the
    # second always finds the first's stop pending, on any machine.
    rc, err = signal_at_step_2(demo_command(demo_data, out), out, tmp_path / "first.log", signal.SIGTERM, signal.SIGINT)
    first = re.search(r"fitlm: (SIGINT|SIGTERM) received: saving a checkpoint at the end of this step", err)
    assert first, err[-3000:]
    name = {"SIGINT": "SIGTERM", "SIGTERM": "SIGINT"}[first[1]]  # the other one came second
    assert rc == 128 + signal.Signals[name], err[-3000:]
    assert f"second signal ({name}): stopped at once, the save at the end of the step was abandoned" in err
    assert "no checkpoint is on disk, so running the same command again starts over from step 1" in err
    assert "is complete" not in err and not list_checkpoints(out / "checkpoints")


def start_dp2(tiny_corpus, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path, Path]:
    """A 2-rank `fitlm train` (the launcher re-runs itself under torchrun, gloo on CPU), checkpoint.interval 0;
    returns once step 2 is logged."""
    out = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus,
        out,
        parallel={"data_parallel": 2},
        train={"max_steps": 100_000, "eval_interval": 0, "micro_batch_size": 2, "observe": {"tensorboard": False}},
    )
    assert "checkpoint" not in cfg  # interval 0: the demo's default
    path = write_config(tmp_path / "dp2.yaml", cfg)
    log = tmp_path / "dp2.log"
    proc = start([sys.executable, "-m", "fitlm.cli", "train", str(path)], log)
    try:
        wait_for(lambda: logged_step(out) >= 2, "step 2 in metrics.jsonl", proc, log)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, out, path, log


def ended(proc: subprocess.Popen, path: Path, log: Path) -> tuple[int, str]:
    """The launcher's exit status and stderr, once every process of the run (marked by its config path) is gone."""
    try:
        rc = proc.wait(WAIT_S)
        deadline = time.monotonic() + 60
        while run_pids(str(path)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not run_pids(str(path)), "a rank outlived its launcher"
    finally:
        for pid in run_pids(str(path)):
            os.kill(pid, signal.SIGKILL)
    return rc, log.read_text()


@pytest.mark.parametrize(
    ("how", "sig"), [("Ctrl-C to the process group", signal.SIGINT), ("kill the launcher", signal.SIGTERM)]
)
def test_a_dp2_run_stopped_saves_once_and_exits_128_plus_the_signal(tiny_corpus, tmp_path, how, sig):
    proc, out, path, log = start_dp2(tiny_corpus, tmp_path)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does: the whole foreground group
    else:
        proc.send_signal(sig)  # `kill PID`, the UI's Stop (the launcher holds the run lock)
    rc, err = ended(proc, path, log)
    name = signal.Signals(sig).name
    assert rc == 128 + sig, err[-3000:]
    (step, ckpt), *_ = list_checkpoints(out / "checkpoints")[::-1]
    meta = read_meta(ckpt)
    assert meta["step"] == step and meta["layout"]["data_parallel"] == 2
    assert err.count(f"{name} received: saving a checkpoint") == 1  # rank 0 speaks, once
    assert err.count(f"stopped by {name} after step {step}; checkpoint {ckpt} is complete") == 1
    assert "Traceback" not in err and "second signal" not in err  # one signal reached the ranks, not two


def test_a_second_signal_to_a_dp2_launcher_stops_every_rank_at_once(tiny_corpus, tmp_path):
    proc, out, path, log = start_dp2(tiny_corpus, tmp_path)
    # Both at once: the launcher's handlers run one after the other, so the second always comes while the first is
    # being passed on (which one is first does not matter).
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    rc, err = ended(proc, path, log)
    second = re.search(
        r"second signal \((SIGINT|SIGTERM)\): every rank was stopped at once, the save was abandoned", err
    )
    assert second and rc == 128 + signal.Signals[second[1]], err[-3000:]
    assert "no checkpoint is on disk, so running the same command again starts over from step 1" in err
    assert "is complete" not in err and not list_checkpoints(out / "checkpoints")
