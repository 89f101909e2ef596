"""CRC-32 of every checkpoint file, recorded at save and checked at resume: truncation and bit flips are caught.

CRC-32 (zlib) is chosen over a cryptographic hash for speed (several GB/s): it guards against damage
(a flipped bit, a torn write, a truncated copy), not against tampering. Each rank hashes the shard
files it wrote (`__{rank}_*.distcp`, DCP's naming), rank 0 also the index and the small files, so
the cost is spread like the writing was; at resume the files are verified the same way, split across ranks.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

CHUNK = 8 * 2**20
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def written_by(directory: Path, rank: int, skip: tuple[str, ...] = ()) -> list[Path]:
    """The files of a checkpoint directory that `rank` wrote: its DCP shards; rank 0 also every other file."""
    mine = []
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name in skip:
            continue
        m = _SHARD.match(p.name)
        if (int(m.group(1)) == rank) if m else rank == 0:
            mine.append(p)
    return mine


def checksums(files: list[Path]) -> dict[str, str]:
    return {p.name: crc32(p) for p in files}


def damaged(directory: Path, expected: dict[str, str], names: list[str]) -> list[str]:
    """Problems among `names` (a share of `expected`): a file whose CRC-32 differs from the one recorded at save."""
    problems = []
    for name in names:
        f = directory / name
        got = crc32(f) if f.is_file() else None
        if got != expected[name]:
            problems.append(
                f"{f} has CRC-32 {got} but {expected[name]} was recorded when it was saved"
                if got is not None
                else f"{f} is missing"
            )
    return problems
