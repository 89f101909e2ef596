"""The work `fitlm ui` starts: `fitlm train` and `fitlm export` as child processes, each with a log file.

Why processes and not threads: a run started from the page is the run `fitlm train CONFIG` would be (the
same launcher, torchrun for several ranks, the same SIGTERM handling), and it outlives the page: the child
gets its own session, so stopping the UI (Ctrl-C) does not stop a training run. Runs are found again
through their run locks (fitlm.ui.runs), whoever started them.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fitlm.progress import PROGRESS_INTERVAL, PROGRESS_LINES
from fitlm.train.run_lock import in_use, lock_status
from fitlm.ui.errors import UIError
from fitlm.ui.runs import run_dir

UI_DIR = ".fitlm-ui"  # under RUNS_DIR: the configs of runs started here and the logs of the jobs
LOG_TAIL = 8000  # characters of a job's log the page shows


@dataclass
class Job:
    id: str
    kind: str  # train or export
    argv: list[str]  # after `fitlm`
    log: Path
    proc: subprocess.Popen
    started: float
    target: str  # the run's name (train) or the written path (export)

    def as_dict(self) -> dict[str, Any]:
        code = self.proc.poll()
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.is_file() else ""
        return {
            "id": self.id,
            "kind": self.kind,
            "command": shlex.join(["fitlm", *self.argv]),
            "state": "running" if code is None else ("done" if code == 0 else "failed"),
            "returncode": code,
            "seconds": round(time.time() - self.started, 1),
            "target": self.target,
            "log": text[-LOG_TAIL:],
            "files": _files(Path(self.target)) if self.kind == "export" else [],
            "progress": _progress(text),
        }


def _progress(log: str) -> list[int] | None:
    """[done, total] of the last "<what>: i/n[, elapsed …]" line the command printed (fitlm.progress.counted), if
    any."""
    found = PROGRESS.findall(log)
    return [int(found[-1][0]), int(found[-1][1])] if found else None


PROGRESS = re.compile(r"^[\w ()]+: (\d+)/(\d+)(?:,.*)?$", re.M)


def _files(path: Path) -> list[dict[str, Any]]:
    if path.is_file():
        return [{"path": str(path), "bytes": path.stat().st_size}]
    if path.is_dir():
        return [{"path": str(p), "bytes": p.stat().st_size} for p in sorted(path.rglob("*")) if p.is_file()]
    return []


class Jobs:
    """The jobs of this UI process, by id."""

    def __init__(self, root: Path):
        self.root = root
        self.jobs: dict[str, Job] = {}
        self._ids = itertools.count(1)

    def _start(self, kind: str, argv: list[str], target: str) -> Job:
        jid = f"{kind}-{next(self._ids)}"
        log = self.root / UI_DIR / "logs" / f"{jid}-{int(time.time())}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w", encoding="utf-8") as f:
            f.write(f"$ {shlex.join(['fitlm', *argv])}\n")
            f.flush()
            # the page draws an export's block count from its log: a line per block, not one every few seconds
            lines = {PROGRESS_LINES: "1", PROGRESS_INTERVAL: "0"} if kind == "export" else {}
            env = dict(os.environ, PYTHONUNBUFFERED="1", **lines)
            proc = subprocess.Popen(
                [sys.executable, "-m", "fitlm.cli", *argv],
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        job = Job(jid, kind, argv, log, proc, time.time(), target)
        self.jobs[jid] = job
        # Reaped as soon as it ends: no zombie whose pid would still answer kill(pid, 0) as alive.
        threading.Thread(target=proc.wait, name=f"fitlm-ui-{jid}", daemon=True).start()
        return job

    def get(self, jid: str) -> Job:
        if jid not in self.jobs:
            raise UIError(f"job {jid}: no such job in this UI (jobs: {', '.join(self.jobs) or 'none'})")
        return self.jobs[jid]

    def start_train(self, data: dict[str, Any], name: str) -> Job:
        """Write the run's config under RUNS_DIR/.fitlm-ui/configs and start `fitlm train` on it into RUNS_DIR/name.

        A live run in that directory refuses with the run lock's own message, before anything is written."""
        name = _run_name(name)
        out = (self.root / name).resolve()
        status, holder = lock_status(out)
        if status == "running":
            raise in_use(out, holder)  # the run lock's own refusal, naming the live run
        data = dict(data, train=dict(data.get("train") or {}, output_dir=str(out)))
        config = self.root / UI_DIR / "configs" / f"{name.replace('/', '_')}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        job = self._start("train", ["train", str(config)], name)
        return _started(job, out)

    def stop_run(self, name: str) -> dict[str, Any]:
        """SIGTERM to the process holding the run's lock: it saves a checkpoint at the end of its step and exits."""
        path = run_dir(self.root, name)
        status, info = lock_status(path)
        if status != "running":
            raise UIError(f"run {name} is not running ({status}); only a live run can be stopped")
        if info.get("host") not in (None, socket.gethostname()):
            raise UIError(f"run {name} runs on host {info['host']}; stop it there (kill -TERM {info['pid']})")
        os.kill(int(info["pid"]), signal.SIGTERM)
        return {"name": name, "signalled": int(info["pid"])}

    def start_export(self, opts: dict[str, Any]) -> Job:
        argv = export_argv(opts)
        return self._start("export", argv, argv[argv.index("--out") + 1])

    def close(self) -> None:
        """Exports die with the UI (they are its work); training runs go on (see the module docstring)."""
        for job in self.jobs.values():
            if job.kind == "export" and job.proc.poll() is None:
                job.proc.terminate()


START_WAIT_S = 120.0  # how long `start` waits for the run to take its lock (imports, data checks) or fail


def _started(job: Job, out: Path) -> Job:
    """The job once its run holds the lock; a run that exits first (a bad data path, a refused resume) raises
    the CLI's own error, from its log."""
    deadline = time.time() + START_WAIT_S
    while time.time() < deadline:
        code = job.proc.poll()
        if code is not None and code != 0:
            lines = job.log.read_text(encoding="utf-8", errors="replace").splitlines()
            first = next((i for i, line in enumerate(lines) if ": error: " in line), max(len(lines) - 3, 0))
            raise UIError(f"the run did not start (exit {code}): " + "\n".join(lines[first:]))
        if code == 0 or lock_status(out)[0] == "running":
            return job
        time.sleep(0.2)
    return job  # still starting (a slow filesystem, a big model): the Runs view shows it once it runs


def _run_name(name: str) -> str:
    name = (name or "").strip().strip("/")
    if not name or name.startswith(".") or ".." in Path(name).parts:
        raise UIError(f"run name {name!r}: give a directory name under RUNS_DIR, e.g. lora-try1")
    return name


EXPORT_FLAGS = {
    "dtype": "--dtype",
    "adapter": "--adapter",
    "seq_len": "--seq-len",
    "batch_size": "--batch-size",
    "max_shard_size": "--max-shard-size",
}
EXPORT_SWITCHES = {"dynamic_shape": "--dynamic-shape", "no_tokenizer": "--no-tokenizer"}


def export_argv(opts: dict[str, Any]) -> list[str]:
    """`fitlm export` arguments from the Export form; the CLI's own parser checks them when the job starts."""
    model, fmt, out = (str(opts.get(k) or "").strip() for k in ("model", "format", "out"))
    missing = [k for k, v in (("model", model), ("format", fmt), ("out", out)) if not v]
    if missing:
        raise UIError(f"export: {', '.join(missing)} must be given (the model, hf/gguf/onnx, the output path)")
    if not Path(model).exists():
        raise UIError(f"export: model {model} does not exist; pick a finished run or give a model path")
    argv = ["export", model, "--format", fmt, "--out", out]
    for key, flag in EXPORT_FLAGS.items():
        if opts.get(key) not in (None, ""):
            argv += [flag, str(opts[key])]
    argv += [flag for key, flag in EXPORT_SWITCHES.items() if opts.get(key)]
    return argv


__all__ = ["Job", "Jobs", "export_argv"]
