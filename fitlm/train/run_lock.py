"""One run per output directory at a time: an advisory lock file, `output_dir/.fitlm-run.lock`.

The lock is an flock on that file, held for the life of the run by the process that started it (the
launcher of a multi-process run, else rank 0). The kernel drops an flock when its holder dies in any
way, so a lock left by a crashed run is never "held": the next run takes it over and says whose it
was. The file keeps the holder's host, pid, start time and command, for the refusal message.
The file is never deleted while in use (deleting would let a second run lock a fresh file beside a
live one); a clean release replaces the holder with how the run ended (`finished`, `stopped` by SIGTERM,
`failed` with an error), which `lock_status` reads back for `fitlm ui` without touching the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from fitlm.config import ConfigError

LOCK_FILE = ".fitlm-run.lock"
HELD_BY = "FITLM_RUN_LOCK_HOLDER"  # env: pid of the launcher holding the lock for the ranks it started


class RunLock:
    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self, outcome: str | None = None) -> None:
        """Let go; `outcome` (finished, stopped, failed) is left in the file for whoever lists the runs."""
        if self._fd < 0:
            return
        try:
            os.ftruncate(self._fd, 0)  # released cleanly: no holder pid, so the next run has nothing to report
            if outcome:
                os.pwrite(self._fd, (json.dumps({"outcome": outcome, "ended": _now()}) + "\n").encode("utf-8"), 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a Trainer that never ran fit (fitlm profile's burst) lets go when collected
        try:
            self.release()
        except OSError:
            pass

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def lock_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / LOCK_FILE


def _holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def in_use(out: Path, who: dict) -> ConfigError:
    """The refusal of a second run into `out`, naming the live run `who` (the lock file's holder record)."""
    return ConfigError(
        [
            f"train.output_dir: {out} is in use by a live run (pid {who.get('pid', '?')} on host "
            f"{who.get('host', '?')}, started {who.get('started', '?')}: {who.get('command', '?')}). "
            "Two runs must not write into one directory: wait for that run to finish, stop it "
            "(SIGTERM saves a checkpoint; the same command resumes), or choose another "
            "train.output_dir"
        ]
    )


def acquire_run_lock(output_dir: str | Path, command: str | None = None) -> RunLock:
    """Lock `output_dir` for this process (creating the directory); ConfigError naming the live run if it is taken."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = lock_path(out)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(fd)
        os.close(fd)
        raise in_use(out, who) from None
    previous = _holder(fd)
    if previous.get("pid"):
        print(
            f"fitlm: {out} was locked by a run that ended without releasing it (pid {previous['pid']} on host "
            f"{previous.get('host', '?')}, started {previous.get('started', '?')}); taking it over",
            file=sys.stderr,
        )
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": _now(),
        "command": command or " ".join(["fitlm", *sys.argv[1:]]),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
    os.fsync(fd)
    return RunLock(path, fd)


def _flock_held(path: Path, pid: Any = None) -> bool | None:
    """Whether some process holds an flock on `path`, read from /proc/locks (None where there is none).

    Read, not probed: taking the lock even for a moment could make a run starting at that instant refuse.
    A line matches on device and inode, or on the inode and the holder's pid: btrfs subvolumes and overlay
    filesystems print another device number there than stat gives.
    """
    try:
        st = path.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        f = line.split()  # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234567 0 EOF"; a waiter has "->" in f[1]
        if f[1:2] != ["FLOCK"] or len(f) < 6:
            continue
        if f[5] == dev or (f[5].rsplit(":", 1)[-1] == str(st.st_ino) and f[4] == str(pid)):
            return True
    return False


def _pid_alive(info: dict) -> bool:
    """Whether the lock file's holder lives: on this host, its pid; on another, unknown, so the file is trusted."""
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def lock_status(output_dir: str | Path) -> tuple[str, dict]:
    """(status, what the lock file says) without taking the lock. Status: `running` (held), `abandoned` (its
    holder died without releasing it: killed or crashed hard), a released run's outcome (`finished`, `stopped`,
    `failed`), `released` (a run of an earlier fitlm that recorded none) or `none` (no lock file)."""
    path = lock_path(output_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return "none", {}
    try:
        info = _holder(fd)
    finally:
        os.close(fd)
    held = _flock_held(path, info.get("pid"))
    if held is None or (not held and info.get("pid") and info.get("host") != socket.gethostname()):
        # No /proc/locks, or another host's run on a shared filesystem (this kernel cannot see its lock):
        # the holder's pid decides (another host's: unknown, so the file is trusted).
        held = bool(info.get("pid")) and _pid_alive(info)
    if held:
        return "running", info
    if info.get("pid"):
        return "abandoned", info
    return str(info.get("outcome", "released")), info


def held_by_launcher(output_dir: str | Path) -> bool:
    """Whether the launcher that started this rank holds the lock of `output_dir` (then the rank takes none)."""
    pid = os.environ.get(HELD_BY)
    if not pid:
        return False
    path = lock_path(output_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return str(_holder(fd).get("pid")) == pid
    finally:
        os.close(fd)


def lock_for_run(ctx, out: Path) -> RunLock | None:
    """Rank 0 locks train.output_dir (unless the launcher that started it holds the lock); every rank stops
    together if it cannot, naming the live run. `ctx` is the run's ParallelContext."""
    lock, refusal = None, None
    if ctx.is_main and not held_by_launcher(out):
        try:
            lock = acquire_run_lock(out)
        except ConfigError as exc:
            refusal = exc
    refused = ctx.any_rank(refusal is not None)
    if refusal is not None:
        raise refusal
    if refused:
        raise ConfigError([f"train.output_dir: {out} is in use by a live run (rank 0 says which)"])
    return lock
