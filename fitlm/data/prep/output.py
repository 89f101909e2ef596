"""What every `fitlm data` output shares: the atomic output directory and its checks, the manifest's
common fields and the progress on stderr (`pack` on either engine, `merge`, `clean`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fitlm.atomic import atomic_dir as atomic_output_dir
from fitlm.data.errors import DataError
from fitlm.data.format import FORMAT, FORMAT_VERSION
from fitlm.data.tokenizer import Tokenizer
from fitlm.diskspace import disk_full_guard
from fitlm.progress import Lines, as_lines, byte_counts

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress


class Progress:
    """Progress over input bytes on stderr (stdout is reserved for --json output): a rich bar on a terminal,
    lines every few seconds elsewhere (fitlm.progress)."""

    def __init__(self, enabled: bool, total: int, label: str = "packing"):
        self._bar: RichProgress | None = None
        self._lines: Lines | None = None
        if enabled and as_lines():
            self._lines = Lines(label, total, counts=byte_counts)
        elif enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn(label),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._bar.add_task(label, total=total)

    def __enter__(self) -> Callable[[int], None]:
        bar, lines = self._bar, self._lines
        if lines is not None:
            return lines.advance
        if bar is None:
            return lambda n: None
        bar.__enter__()
        return lambda n: bar.advance(self._task, n)

    def __exit__(self, *exc) -> None:
        if self._lines is not None and exc[0] is None:
            self._lines.close()  # the end, also where the bytes read fell short of the files' sizes
        if self._bar is not None:
            self._bar.__exit__(*exc)


def check_out_dir(out_dir: Path, files: Sequence[Path], overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {out_dir} exists and is not a directory; choose a directory path for --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise DataError(
            f"output directory {out_dir} is not empty; choose a new or empty directory, "
            "or pass --overwrite to replace its contents"
        )
    root = out_dir.resolve()
    for f in files:
        if root == f.resolve() or root in f.resolve().parents:
            raise DataError(
                f"input {f} lies inside the output directory {out_dir}; write the packed data somewhere else"
            )


def atomic_dir(
    out_dir: Path,
    write: Callable[[Path], dict],
    what: str = "fitlm data",
    needed: int | Callable[[], int | None] | None = None,
) -> dict:
    """Run `write(tmp)` in a temporary sibling of `out_dir`, then move it into place (fitlm.atomic).

    A full disk (ENOSPC/EDQUOT) becomes a DiskFullError naming `out_dir` and `needed` bytes, raised after
    the temporary directory is gone and any previous `out_dir` is back in place."""
    with disk_full_guard(out_dir, needed, what), atomic_output_dir(out_dir) as tmp:
        return write(tmp)


def base_manifest(tok: Tokenizer, dtype: np.dtype, data_format: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "data_format": data_format,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.sha256,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "special_tokens": tok.special_tokens,
    }


__all__ = ["Progress", "atomic_dir", "base_manifest", "check_out_dir"]
