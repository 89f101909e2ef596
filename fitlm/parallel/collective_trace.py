"""Which collective a rank was inside when it died: the name, the tensor and the mesh dimension.

A collective whose two sides disagree (a shape mismatch) aborts the process from gloo's C++ threads
("terminate called after throwing an instance of 'gloo::EnforceNotMet' ... 131072 vs 65536"): no Python
`except` runs, and torchrun only reports "Signal 6 (SIGABRT)". So each rank writes a one-line record of
the collective it is entering into a small per-rank file (overwritten in place, no fsync: a few writes
per step) and marks it done on the way out; `faulthandler` writes the Python stack of an abort beside it.
After a failed job, the launcher (`fitlm.parallel.launch`) reads the records of the ranks that were
inside one and prints them, e.g.

    rank 1 was inside send/recv of the tied embedding gradient lm_head.weight (the tied copy)
    (local [256, 64] float32, 65536 bytes) over mesh dimension pp with pp rank 0

The directory comes from the launcher through TRACE_ENV; without it (a single process, or a job started
by the user's own torchrun) every call is a no-op.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
from pathlib import Path
from typing import Any, Iterator

TRACE_ENV = "FITLM_COLLECTIVE_TRACE"  # a directory the launcher makes; each rank writes rank{R}.json there
_state: dict[str, Any] = {}  # this process's open record file, once `_file()` opened it


def _file():
    """This rank's record file, opened on first use (None when not traced)."""
    if "fd" in _state:
        return _state["fd"]
    root = os.environ.get(TRACE_ENV)
    fd = None
    if root and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
        with contextlib.suppress(OSError):
            fd = os.open(Path(root) / f"rank{rank}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            stack = open(Path(root) / f"rank{rank}.stack", "w")  # noqa: SIM115 - kept open for faulthandler
            faulthandler.enable(file=stack, all_threads=True)
            _state["stack"] = stack
    _state["fd"] = fd
    return fd


def _write(record: dict[str, Any]) -> None:
    fd = _file()
    if fd is None:
        return
    data = json.dumps(record).encode()
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def describe(tensor: Any) -> str:
    """'[512, 64] float32, 131072 bytes' of a tensor (its local shard for a DTensor)."""
    local = getattr(tensor, "_local_tensor", tensor)
    shape = list(getattr(local, "shape", []))
    dtype = str(getattr(local, "dtype", "")).replace("torch.", "")
    nbytes = local.numel() * local.element_size() if hasattr(local, "numel") else 0
    return f"local {shape} {dtype}, {nbytes} bytes"


@contextlib.contextmanager
def collective(op: str, what: str, dim: str, tensor: Any = None, peer: str = "") -> Iterator[None]:
    """Record that this rank is inside collective `op` ("all-reduce", "send/recv") of `what` (the tensor's
    role and name) over mesh dimension `dim`, for the time of the block."""
    record = {
        "op": op,
        "what": what,
        "dim": dim,
        "tensor": describe(tensor) if tensor is not None else "",
        "peer": peer,
        "inside": True,
    }
    _write(record)
    yield
    _write(dict(record, inside=False))


def read_reports(root: Path | str, world: int, skip: int | None = None) -> list[str]:
    """One sentence per rank (but `skip`) that was inside a collective when the job ended (none after a clean exit)."""
    lines = []
    for rank in range(world):
        if rank == skip:
            continue
        try:
            rec = json.loads((Path(root) / f"rank{rank}.json").read_text() or "{}")
        except (OSError, ValueError):
            continue
        if not rec.get("inside"):
            continue
        tensor = f" ({rec['tensor']})" if rec.get("tensor") else ""
        peer = f" with {rec['peer']}" if rec.get("peer") else ""
        stack = Path(root) / f"rank{rank}.stack"
        where = f"; its Python stack is in {stack}" if stack.exists() and stack.stat().st_size else ""
        lines.append(
            f"rank {rank} was inside {rec['op']} of {rec['what']}{tensor} over mesh dimension {rec['dim']}{peer}{where}"
        )
    return lines


def reports_of_this_job(world: int, skip: int | None = None) -> list[str]:
    """`read_reports` of the job this process belongs to ([] when fitlm's launcher did not start it)."""
    root = os.environ.get(TRACE_ENV)
    return read_reports(root, world, skip) if root else []
