"""Read and write .safetensors files one tensor at a time.

The format is simple (8-byte header length, JSON header with dtype/shape/byte offsets, raw
little-endian data). safetensors' own writer needs every tensor in memory at once; here, with all
shapes known up front, the header is written first and each tensor at its offset as soon as it
exists: peak memory is the largest tensor, whatever the model size. Its reader memory-maps the file,
so every page a load touches stays resident in the process until the file is closed; here each
tensor is read with plain file reads into its own buffer, so a rank that keeps only slices of a
model holds only those (plus the tensor being read).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Iterable

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFormatError(ValueError):
    """A file that is not a readable safetensors file; the message names it."""


class SafetensorsReader:
    """The tensor table of one .safetensors file and `read(name)`: that tensor alone, from the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise SafetensorsFormatError(
                f"{self.path}: not a readable safetensors file ({e}); download or save it again"
            ) from None
        self._data_start = 8 + n
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            if entry.get("dtype") not in NAMES:
                raise SafetensorsFormatError(
                    f"{self.path}: tensor {name!r} has dtype {entry.get('dtype')!r}, which "
                    f"fitlm does not read ({', '.join(NAMES)})"
                )
            begin, end = entry["data_offsets"]
            self.entries[name] = (NAMES[entry["dtype"]], tuple(entry["shape"]), begin, end)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        dtype, shape, _, _ = self.entries[name]
        return dtype, shape

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin)
            if f.readinto(memoryview(raw.numpy())) != end - begin:  # type: ignore[arg-type]  # (numpy: see write)
                raise SafetensorsFormatError(
                    f"{self.path}: tensor {name!r} is cut short; the file is truncated, download or save it again"
                )
        return raw.view(dtype).reshape(shape)


class StreamingSafetensorsWriter:
    """`with StreamingSafetensorsWriter(path, {name: (dtype, shape)}) as w: w.write(name, tensor) ...`

    Written to `path`.tmp and renamed on a clean exit, after checking every declared tensor arrived.
    """

    def __init__(
        self,
        path: str | Path,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        pos = 0
        # Widest dtypes first (as safetensors orders them): every tensor starts aligned to its element size.
        for name in sorted(specs, key=lambda k: (-torch.empty((), dtype=specs[k][0]).element_size(), k)):
            dtype, shape = specs[name]
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.offsets[name] = (pos, pos + n, dtype, tuple(shape))
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._data_start = 8 + len(raw)
        self._size = pos
        self._head = struct.pack("<Q", len(raw)) + raw
        self._written: set[str] = set()

    def __enter__(self) -> StreamingSafetensorsWriter:
        self._f = open(self.tmp, "wb")
        self._f.write(self._head)
        self._f.truncate(self._data_start + self._size)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        begin, end, dtype, shape = self.offsets[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"{name}: got {tensor.dtype} {list(tensor.shape)}, declared {dtype} {list(shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        assert data.nbytes == end - begin
        self._f.seek(self._data_start + begin)
        # numpy's stubs give ndarray `__buffer__` (typeshed's Buffer) only for Python 3.12+; mypy targets 3.11
        self._f.write(memoryview(data))  # type: ignore[arg-type]
        self._written.add(name)

    def write_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            self.write(name, t)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        missing = set(self.offsets) - self._written
        if exc_type is None and missing:
            exc = RuntimeError(f"tensors never written: {sorted(missing)[:5]}")
        if exc_type is not None or missing:
            self.tmp.unlink(missing_ok=True)
            if exc_type is None:
                raise exc
            return
        os.replace(self.tmp, self.path)


def spec_bytes(spec: tuple[torch.dtype, tuple[int, ...]]) -> int:
    dtype, shape = spec
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def write_safetensors_stream(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    max_shard_bytes: int,
) -> list[Path]:
    """Write model.safetensors -- or, past `max_shard_bytes`, numbered shards plus model.safetensors.index.json
    as Hugging Face lays them out -- from tensors that arrive one at a time, in any order (`specs`: every
    tensor's dtype and shape, known up front). Peak memory: the tensor being written."""
    out_dir = Path(out_dir)
    shards: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = [{}]
    size = 0
    for name, spec in specs.items():
        n = spec_bytes(spec)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = spec
        size += n
    if len(shards) == 1:
        files = [out_dir / "model.safetensors"]
    else:
        files = [out_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    where = {name: i for i, shard in enumerate(shards) for name in shard}
    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(StreamingSafetensorsWriter(f, shard)) for f, shard in zip(files, shards)]
        for name, t in tensors:
            writers[where[name]].write(name, t)
            del t  # not held while the next one is produced: a gathered block, or the embedding (rank 0's save peak)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(spec_bytes(s) for s in specs.values())},
            "weight_map": {name: files[i].name for name, i in where.items()},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files
