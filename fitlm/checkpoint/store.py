"""The checkpoint directory on disk: names, completeness, the metadata file, cleanup and pruning.

    output_dir/checkpoints/
        step_00000040/            complete: renamed into place after every rank finished writing
            .metadata             torch.distributed.checkpoint index (read with a restricted unpickler)
            __0_0.distcp ...      tensor data written by each rank
            extra_state.json      loader / loss-scaler state (rank 0's; identical on every rank)
            tokenizer.json        the run's tokenizer, so a checkpoint is self-contained
            fitlm_checkpoint.json written last: step, resolved config, layout, versions, file sizes
        .tmp-step_00000050/       a save in progress (or a crashed one: removed on the next start)

A checkpoint is visible only under its final name, and only with its metadata file, so a crash at
any point of a save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fitlm.atomic import fsync_dir
from fitlm.checkpoint.errors import CheckpointError

CKPT_DIR = "checkpoints"
META_FILE = "fitlm_checkpoint.json"
EXTRA_FILE = "extra_state.json"
FORMAT = "fitlm-checkpoint"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step_(\d{8})$")


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """A single process saves and loads with no_dist=True on purpose; DCP warns about it anyway."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CKPT_DIR


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every finally-named checkpoint directory, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run directory (validated later by `read_meta`), or None."""
    found = list_checkpoints(checkpoints_root(output_dir))
    return found[-1][1] if found else None


def clean_stale(root: Path) -> list[Path]:
    """Remove temporary directories left by saves that never finished (call on one rank, at start)."""
    stale = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints."""
    done = list_checkpoints(root)
    old = [p for _, p in done[:-keep_last]] if keep_last > 0 else []
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, meta: dict[str, Any]) -> Path:
    """Make a fully written temporary checkpoint visible: metadata (with every file's size) last, then rename."""
    meta = dict(meta, files={p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()})
    write_json(tmp / META_FILE, meta)
    fsync_dir(tmp)
    final = tmp.parent / tmp.name.removeprefix(TMP_PREFIX)
    if final.exists():  # a checkpoint of this step from an earlier attempt: the new one replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(tmp.parent)
    return final


def read_meta(ckpt: str | Path, verify_files: bool = True) -> dict[str, Any]:
    """The metadata of a complete checkpoint; CheckpointError naming the file for anything missing or damaged."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(
            f"checkpoint {ckpt} does not exist or is not a directory; pass a checkpoints/step_N "
            "directory of a training run"
        )
    path = ckpt / META_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt} has no {META_FILE}: it is not a complete fitlm checkpoint (a save that did not "
            "finish, or files removed by hand). Delete it to resume from the previous checkpoint, "
            "or pass another checkpoint directory"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e}); the checkpoint is damaged: delete {ckpt} to resume "
            "from the previous checkpoint"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not fitlm checkpoint metadata "
            f"(format={meta.get('format') if isinstance(meta, dict) else None!r})"
        )
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format_version {version!r} is newer than this fitlm reads "
            f"({FORMAT_VERSION}); upgrade fitlm"
        )
    if verify_files:
        for name, size in meta.get("files", {}).items():
            f = ckpt / name
            if not f.is_file():
                raise CheckpointError(
                    f"checkpoint file {f} is missing; the checkpoint is incomplete: delete {ckpt} "
                    "to resume from the previous checkpoint"
                )
            if f.stat().st_size != size:
                raise CheckpointError(
                    f"checkpoint file {f} has {f.stat().st_size} bytes but {size} were written: "
                    f"it is truncated or modified. Delete {ckpt} to resume from the previous "
                    "checkpoint (or restore the file)"
                )
    return meta


# --------------------------------------------------------------------------- DCP's index, read safely


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle. Only DCP's own metadata classes and plain torch types may appear in
    it; anything else (e.g. a callable planted in a downloaded checkpoint) is refused, never run."""

    _ALLOWED_MODULES = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
        "torch.distributed.checkpoint._extension",
    )
    _ALLOWED = {
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("torch", "device"),
        ("torch", "layout"),
        ("torch", "memory_format"),
        ("builtins", "slice"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in self._ALLOWED_MODULES or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def read_dcp_metadata(ckpt: Path) -> Metadata:
    path = Path(ckpt) / ".metadata"
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: {ckpt} is not a torch.distributed.checkpoint directory or is "
            f"incomplete; delete it to resume from the previous checkpoint"
        )
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(
            f"{path} cannot be read safely ({e}); the checkpoint is damaged or not from "
            "fitlm: delete it or pass another checkpoint"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path} does not hold a checkpoint index")
    return md


class SafeReader(FileSystemReader):
    """FileSystemReader whose index is read with the restricted unpickler (tensor data is already read with
    torch.load(weights_only=True) by DCP), and cached so that streaming one tensor at a time stays cheap."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self._md: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._md is None:
            self._md = read_dcp_metadata(Path(self.path))
        if getattr(self._md, "storage_meta", None) is None:
            self._md.storage_meta = StorageMeta()
        assert self._md.storage_meta is not None  # (set just above when missing)
        self._md.storage_meta.load_id = self.load_id
        return self._md
