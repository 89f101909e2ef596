"""One run per output directory: a live run's lock refuses a second run (naming host and pid); a crashed run's is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from fitlm.cli import main
from fitlm.config import ConfigError
from fitlm.train.run_lock import LOCK_FILE, acquire_run_lock, lock_status
from tests.e2e.helpers import tiny_config, write_config


def holder(out, hold: bool) -> subprocess.Popen | subprocess.CompletedProcess:
    """Another process takes the lock of `out`: holding it (alive) or dying without releasing it (a crash)."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from fitlm.train.run_lock import acquire_run_lock
        lock = acquire_run_lock({str(out)!r}, "fitlm train other.yaml")
        print("locked", flush=True)
        if {hold}:
            time.sleep(120)
        os._exit(9)  # a crash: no release, the file still names this pid
    """)
    if hold:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "locked"
        return proc
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def tree(root) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.process
def test_live_lock_refuses_naming_host_and_pid(tmp_path):
    proc = holder(tmp_path / "run", hold=True)
    try:
        with pytest.raises(ConfigError) as err:
            acquire_run_lock(tmp_path / "run")
        msg = str(err.value)
        assert f"pid {proc.pid}" in msg and socket.gethostname() in msg and "other.yaml" in msg
        assert "train.output_dir" in msg
    finally:
        proc.kill()
        proc.wait()
    with acquire_run_lock(tmp_path / "run") as lock:  # the holder died: the lock is free again
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert lock.path.read_text() == ""  # released cleanly: nothing for the next run to report


@pytest.mark.process
def test_lock_status_reads_holder_and_outcome_without_taking_the_lock(tmp_path):
    assert lock_status(tmp_path / "run") == ("none", {})
    proc = holder(tmp_path / "run", hold=True)
    try:
        status, info = lock_status(tmp_path / "run")
        assert status == "running" and info["pid"] == proc.pid
        with pytest.raises(ConfigError):  # reading the status did not let anyone else in
            acquire_run_lock(tmp_path / "run")
    finally:
        proc.kill()
        proc.wait()
    assert lock_status(tmp_path / "run")[0] == "abandoned"  # killed: the file still names the dead holder
    for outcome in ("finished", "stopped", "failed"):
        acquire_run_lock(tmp_path / "run").release(outcome)
        assert lock_status(tmp_path / "run")[0] == outcome
    acquire_run_lock(tmp_path / "run").release()
    assert lock_status(tmp_path / "run")[0] == "released"


def test_a_run_records_how_it_ended(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_corpus, out, train={"max_steps": 1, "eval_interval": 0}))
    assert main(["train", str(cfg)]) == 0
    assert lock_status(out)[0] == "finished"
    diverges = [
        "--set",
        "train.max_steps=3",
        "--set",
        "train.lr=1e30",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.observe.guards.nonfinite=stop",
    ]
    assert main(["train", str(cfg), "--overwrite", *diverges]) == 2  # the guard stops it with an error
    assert lock_status(out)[0] == "failed"


@pytest.mark.process
def test_lock_of_a_crashed_run_is_taken_over_and_said(tmp_path, capsys):
    crashed = holder(tmp_path / "run", hold=False)
    assert crashed.returncode == 9
    left = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    with acquire_run_lock(tmp_path / "run"):
        err = capsys.readouterr().err
        assert f"pid {left['pid']}" in err and "taking it over" in err
    with acquire_run_lock(tmp_path / "run"):  # a clean release before: no takeover message
        assert "taking it over" not in capsys.readouterr().err


@pytest.mark.process
def test_second_train_into_a_live_run_is_refused_and_changes_nothing(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = write_config(
        tmp_path / "c.yaml",
        tiny_config(tiny_corpus, out, train={"max_steps": 2, "eval_interval": 0}, checkpoint={"interval": 1}),
    )
    assert main(["train", str(cfg)]) == 0
    capsys.readouterr()
    # "More steps" continues the finished run: allowed by the config check, refused by the live lock.
    proc = holder(out, hold=True)
    try:
        before = tree(out)
        time.sleep(0.01)
        code = main(["train", str(cfg), "--set", "train.max_steps=4"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"pid {proc.pid}" in err and str(out) in err
        assert tree(out) == before  # nothing written, nothing removed
    finally:
        proc.kill()
        proc.wait()
    assert main(["train", str(cfg), "--set", "train.max_steps=4"]) == 0  # the lock is free again


def test_overwrite_keeps_the_lock_it_holds(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_corpus, out, train={"max_steps": 1, "eval_interval": 0}))
    assert main(["train", str(cfg)]) == 0
    assert main(["train", str(cfg), "--overwrite"]) == 0
    assert (out / LOCK_FILE).is_file() and (out / "model").is_dir()
