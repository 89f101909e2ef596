"""Publish files and directories atomically: write aside, then rename into place.

Every writer of user-visible output (tokenizers, packed data, model directories, adapters, exports)
goes through here, so a crash, a Ctrl-C or a bad input half-way never leaves a truncated file or a
half-filled directory at the target, and a previous version survives until the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it, a new file) durable."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file directly under `path`, then `path` itself: a rename is only crash-safe if the
    data it publishes has reached the disk first."""
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


@contextlib.contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on a clean exit it replaces `path`, on an error it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path | str, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_dir(out_dir: Path | str, durable: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of `out_dir` to fill; on a clean exit it becomes `out_dir`.

    An existing `out_dir` (the caller decided it may be replaced) is swapped out and deleted only
    once the new one is in place; if the swap fails half-way the old one is put back. On any error
    nothing new is left behind, not even parent directories this call created. `durable` fsyncs the
    new files before the rename (model directories: a power loss must not publish empty files).
    """
    out_dir = Path(out_dir)
    created = [p for p in [out_dir.parent, *out_dir.parent.parents] if not p.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old: Path | None = None
    try:
        yield tmp
        if durable:
            fsync_tree(tmp)
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except BaseException:
        if old is not None and not out_dir.exists():
            os.rename(old, out_dir)  # the swap failed half-way: put the previous version back
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # innermost first
            try:
                p.rmdir()
            except OSError:
                break
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_stale(directory: Path | str) -> list[Path]:
    """Tidy what a killed `atomic_dir` / `atomic_file` left directly inside `directory`; the removed paths.

    A temporary (`.NAME.tmp-*`) is removed. A swapped-out previous version (`.NAME.old-*`) is put back
    when NAME is missing (the process died between the two renames of a replace), else removed.
    Call it only where no other process is writing (the trainer holds the run lock).
    """
    directory = Path(directory)
    done: list[Path] = []
    if not directory.is_dir():
        return done
    for p in sorted(directory.iterdir()):
        name, kind = _parse_temp(p.name)
        if name is None:
            continue
        target = directory / name
        if kind == "old" and not target.exists():
            os.rename(p, target)
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        done.append(p)
    return done


def _parse_temp(name: str) -> tuple[str | None, str]:
    """(target name, "tmp" or "old") for names atomic_dir/atomic_file create, else (None, "")."""
    if not name.startswith("."):
        return None, ""
    for kind in ("tmp", "old"):
        head, sep, tail = name[1:].rpartition(f".{kind}-")
        if sep and head and tail:
            return head, kind
    return None, ""
