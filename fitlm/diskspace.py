"""A full disk is a user problem with a clear fix: say which directory, how many bytes were needed, how many are free.

Writers wrap their work in `disk_full_guard(directory, needed_bytes, what)`: an OSError with ENOSPC (no
space) or EDQUOT (quota) becomes a `DiskFullError`, which the CLI prints as one paragraph (exit status 2).
`needed_bytes` may be a callable, asked only when the disk is full: a writer that cannot know its size
up front (packing) extrapolates from what it wrote before the failure.
The caller's own cleanup (fitlm.atomic removes its temporary files; the checkpointer removes its
temporary directory) runs before the error leaves, so nothing half-written is left behind.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
MiB = 2**20


class DiskFullError(ValueError):
    """A write ran out of space; the text names the directory, the bytes needed and the bytes free."""

    def __init__(self, directory: Path, needed: int | None, what: str, cause: OSError | None = None):
        self.directory, self.needed = Path(directory), needed
        self.free = free_bytes(self.directory)
        need = f"about {needed / MiB:,.1f} MiB are needed" if needed else "more space is needed"
        free = f", {self.free / MiB:,.1f} MiB are free" if self.free is not None else ""
        super().__init__(
            f"{what}: the disk holding {self.directory} is full ({need}{free}); the partial files were "
            f"removed and earlier results are intact. Free space there (or point the output at "
            f"another disk) and run the same command again"
            + (f" [{cause.strerror}]" if cause is not None and cause.strerror else "")
        )


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent), or None if unknown."""
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def tensor_bytes(tensors: Iterable, float_itemsize: int | None = None) -> int:
    """Bytes the tensors occupy once written (tied tensors, sharing one storage, counted once);
    `float_itemsize`: floating-point tensors are written at that size (e.g. 4 where float32 is stored)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        size = float_itemsize if float_itemsize and t.is_floating_point() else t.element_size()
        if hasattr(t, "full_tensor"):  # a DTensor: its global size is what gets written
            seen[("dtensor", id(t))] = t.numel() * size
            continue
        key = (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        seen[key] = t.numel() * size
    return sum(seen.values())


@contextlib.contextmanager
def disk_full_guard(directory: Path | str, needed: int | Callable[[], int | None] | None, what: str) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT raised inside the block into a DiskFullError naming `directory`; others pass through.

    Put the guard outside the atomic_file/atomic_dir block it protects, so their cleanup has run (and the
    free space they gave back is counted) before the message is written."""
    try:
        yield
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        if callable(needed):
            try:
                needed = needed()
            except Exception:  # noqa: BLE001 - an estimate must never hide the disk-full message
                needed = None
        raise DiskFullError(Path(directory), needed, what, exc) from exc
