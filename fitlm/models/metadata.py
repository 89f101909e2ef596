"""Provenance of an export: which fitlm/torch wrote it, the export format version, and the source hash.

A deployed file outlives the code that wrote it; the record lets a later fitlm say clearly "this was
written by a newer format" instead of failing obscurely on a missing key or a changed layout.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from fitlm import __version__

EXPORT_FORMAT_VERSION = 1
METADATA_FILE = "fitlm_export.json"  # beside the weights for hf; "<file>.fitlm.json" for single-file formats


class ExportCompatibilityWarning(UserWarning):
    """An export written by an incompatible fitlm/format version: loading may go wrong."""


def weights_sha256(path: Path) -> str:
    """sha256 over the source's weight files (sorted by name), so two exports of one checkpoint match."""
    files = (
        [path] if path.is_file() else sorted([*path.glob("*.safetensors"), *path.glob("model.safetensors.index.json")])
    )
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def build_metadata(fmt: str, source: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "format": fmt,
        "format_version": EXPORT_FORMAT_VERSION,
        "fitlm_version": __version__,
        "torch_version": torch.__version__,
        "source": str(source),
        "source_sha256": weights_sha256(source),
        **(extra or {}),
    }


def metadata_path(out: Path) -> Path:
    """Where the record of `out` lives: inside an export directory, else a sibling `<file>.fitlm.json`."""
    return out / METADATA_FILE if out.is_dir() else out.with_name(out.name + ".fitlm.json")


def write_metadata(out: Path, meta: dict[str, Any]) -> Path:
    p = metadata_path(out)
    p.write_text(json.dumps(meta, indent=2) + "\n")
    return p


def _major_minor(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:2])
    except ValueError:
        return ()


def check_metadata(meta: dict[str, Any], where: str) -> list[str]:
    """Warn (ExportCompatibilityWarning) for every incompatibility; return the messages."""
    problems = []
    version = meta.get("format_version")
    if not isinstance(version, int) or version > EXPORT_FORMAT_VERSION:
        problems.append(
            f"{where}: export format_version {version!r} is newer than this fitlm reads "
            f"({EXPORT_FORMAT_VERSION}); upgrade fitlm (`pip install -U fitlm`) or re-export"
        )
    theirs, ours = _major_minor(str(meta.get("fitlm_version", ""))), _major_minor(__version__)
    if theirs and ours and theirs > ours:
        problems.append(
            f"{where}: written by fitlm {meta.get('fitlm_version')}, newer than this fitlm "
            f"{__version__}; upgrade fitlm if loading fails"
        )
    for msg in problems:
        warnings.warn(msg, ExportCompatibilityWarning, stacklevel=2)
    return problems


def read_metadata(out: Path) -> dict[str, Any] | None:
    """The export record of `out` (checked; warnings on incompatibility), or None when there is none."""
    p = metadata_path(Path(out))
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except ValueError:
        warnings.warn(
            f"{p}: export metadata is not valid JSON; its provenance is unknown",
            ExportCompatibilityWarning,
            stacklevel=2,
        )
        return None
    check_metadata(meta, str(p))
    return meta
