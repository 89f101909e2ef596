"""Write a .safetensors file one tensor at a time.

safetensors' own writer needs every tensor in memory at once. The format is simple (8-byte header
length, JSON header with dtype/shape/byte offsets, raw little-endian data), so with all shapes known
up front the header is written first and each tensor is written at its offset as soon as it exists:
peak memory is the largest tensor, whatever the model size.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


class StreamingSafetensorsWriter:
    """`with StreamingSafetensorsWriter(path, {name: (dtype, shape)}) as w: w.write(name, tensor) ...`

    Written to `path`.tmp and renamed on a clean exit, after checking every declared tensor arrived.
    """

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        pos = 0
        for name in sorted(specs):
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
        self._f.write(memoryview(data))
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
