"""The packed-data format: file names, versions, token dtype, checksums, and reading a manifest.

Version 2 (written now) is a directory of shards plus one manifest:

    manifest.json                 {"format": "fitlm-packed", "format_version": 2, "data_format": "text"|"chat",
                                   dtype, num_tokens, num_docs, vocab_size, tokenizer_sha256, bos_id, eos_id,
                                   pad_id, special_tokens, shards: [...], checksums (tokenizer files), counts, ...}
    shard-00000.tokens.bin        flat token stream of the shard, `dtype`, documents back to back
    shard-00000.offsets.npy       int64[docs + 1]: start of each document in the shard, then its end
    shard-00000.mask.bin          chat only: uint8 per token, 1 = the token is a training target (assistant)
    tokenizer.json                byte-for-byte copy of the tokenizer (+ tokenizer_config.json if it had one)

Each entry of `shards` is {"name", "num_tokens", "num_docs", "files": {"tokens", "offsets"[, "mask"]},
"checksums": {file: sha256}}, so a corrupt shard is named by itself. Version 1 (session 1: one
tokens.bin + doc_offsets.npy) is still read, as a directory with one text shard.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from fitlm.data.errors import DataError

FORMAT = "fitlm-packed"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
# Version 1 names (one shard, no mask).
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.npy"
DATA_FORMATS = ("text", "chat")
_REQUIRED = ("dtype", "num_tokens", "num_docs", "vocab_size", "tokenizer_sha256", "bos_id", "eos_id", "pad_id")
_DTYPES = ("uint16", "uint32")


def shard_files(index: int, chat: bool) -> dict[str, str]:
    """File names of shard `index` (5 digits: 100k shards before the names stop sorting)."""
    stem = f"shard-{index:05d}"
    files = {"tokens": f"{stem}.tokens.bin", "offsets": f"{stem}.offsets.npy"}
    if chat:
        files["mask"] = f"{stem}.mask.bin"
    return files


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 .. vocab_size-1) fits, else uint32: half the disk and page cache for
    vocabularies up to 65536."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of packed directory `path`, normalised to version 2's shape (v1 gets one shard)."""
    hint = f"run `fitlm data pack ... --out {path}` first"
    if not path.is_dir():
        raise DataError(f"packed data directory {path} does not exist; {hint} (or fix data.train / data.valid)")
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        raise DataError(f"{path} is not packed data (it has no {MANIFEST_FILE}); {hint}")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{mpath} is not valid JSON ({e}); re-run `fitlm data pack`") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise DataError(
            f"{path} is not fitlm packed data ({MANIFEST_FILE} has format={got!r}, expected {FORMAT!r}); {hint}"
        )
    version = m.get("format_version")
    if version not in READABLE_VERSIONS:
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise DataError(
                f"{path} uses packed-data format_version {version}, newer than this fitlm reads "
                f"({FORMAT_VERSION}); upgrade fitlm or re-pack the data with this version"
            )
        raise DataError(
            f"{path} has unknown packed-data format_version {version!r} (this fitlm reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}); re-run `fitlm data pack`"
        )
    missing = [k for k in _REQUIRED if k not in m]
    if version == 2 and "shards" not in m:
        missing.append("shards")
    if missing:
        raise DataError(f"{mpath} lacks {', '.join(missing)}; re-run `fitlm data pack`")
    if m["dtype"] not in _DTYPES:
        raise DataError(
            f"{mpath} has dtype {m['dtype']!r}; expected one of {', '.join(_DTYPES)}; re-run `fitlm data pack`"
        )
    if version == 1:
        checks = m.get("checksums", {})
        m = {
            **m,
            "data_format": "text",
            "shards": [
                {
                    "name": "tokens.bin",
                    "num_tokens": m["num_tokens"],
                    "num_docs": m["num_docs"],
                    "files": {"tokens": TOKENS_FILE, "offsets": OFFSETS_FILE},
                    "checksums": {k: checks[k] for k in (TOKENS_FILE, OFFSETS_FILE) if k in checks},
                }
            ],
            "checksums": {k: v for k, v in checks.items() if k not in (TOKENS_FILE, OFFSETS_FILE)},
        }
    if m.get("data_format", "text") not in DATA_FORMATS:
        raise DataError(
            f"{mpath} has data_format {m.get('data_format')!r}; expected text or chat; re-run `fitlm data pack`"
        )
    m.setdefault("data_format", "text")
    return m


__all__ = [
    "DATA_FORMATS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "OFFSETS_FILE",
    "READABLE_VERSIONS",
    "TOKENS_FILE",
    "read_manifest",
    "sha256_file",
    "shard_files",
    "token_dtype",
]
