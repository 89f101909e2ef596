"""`fitlm data merge`: join packed directories (e.g. the parts of `pack --shard-index i --num-shards n`
run on several machines) into one, without re-tokenizing.

Every part is verified (checksums) first, and all must share the tokenizer, token dtype and data format.
Shard files are hard-linked when the filesystem allows (else copied) under new sequential names, so the
merged directory does not depend on the parts afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from fitlm import __version__
from fitlm.data.dataset import PackedDataset
from fitlm.data.errors import DataError
from fitlm.data.format import MANIFEST_FILE, sha256_file, shard_files
from fitlm.data.prep.output import atomic_dir, base_manifest, check_out_dir

_SAME = ("tokenizer_sha256", "dtype", "data_format", "vocab_size", "bos_id", "eos_id", "pad_id")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _check_parts(parts: list[PackedDataset]) -> None:
    first = parts[0]
    for p in parts[1:]:
        diff = [k for k in _SAME if p.manifest.get(k) != first.manifest.get(k)]
        if diff:
            raise DataError(
                f"cannot merge {p.path} with {first.path}: they differ in {', '.join(diff)}; "
                "pack every part with the same tokenizer and --format"
            )
    infos = [p.manifest.get("part") for p in parts]
    if any(infos):
        counts = {i["count"] for i in infos if i}
        if None in infos or len(counts) != 1:
            raise DataError(
                "cannot merge: some inputs are parts of a split pack (--shard-index/--num-shards) and "
                "some are not, or they were split differently; merge the parts of one pack"
            )
        n = counts.pop()
        have = sorted(i["index"] for i in cast(list[dict[str, Any]], infos))  # (None in infos is refused above)
        if have != list(range(n)):
            missing = sorted(set(range(n)) - set(have))
            dup = sorted({i for i in have if have.count(i) > 1})
            raise DataError(
                f"cannot merge: parts of {n} expected; missing {missing or 'none'}, repeated {dup or 'none'}; "
                "pass every part exactly once"
            )


def merge_packed(
    inputs: Sequence[Path | str], out_dir: Path | str, overwrite: bool = False, verify: bool = True
) -> dict[str, Any]:
    """Merge packed directories into `out_dir` (parts of a split pack are ordered by part index)."""
    if not inputs:
        raise DataError("no packed directories to merge; pass two or more")
    parts = [PackedDataset(p) for p in inputs]
    _check_parts(parts)
    if all(p.manifest.get("part") for p in parts):
        parts.sort(key=lambda p: p.manifest["part"]["index"])
    if verify:
        for p in parts:
            p.verify()
    out_dir = Path(out_dir)
    check_out_dir(out_dir, [p.path for p in parts], overwrite)
    chat = parts[0].data_format == "chat"

    def write(tmp: Path) -> dict:
        shards, index = [], 0
        for p in parts:
            for entry in p.manifest["shards"]:
                names = shard_files(index, chat)
                checks = {}
                for key, src in entry["files"].items():
                    _link_or_copy(p.path / src, tmp / names[key])
                    old = entry.get("checksums", {}).get(src)
                    checks[names[key]] = old if old else sha256_file(tmp / names[key])
                shards.append({**entry, "name": names["tokens"].split(".")[0], "files": names, "checksums": checks})
                index += 1
        copied = parts[0].load_tokenizer().copy_to(tmp)
        lengths = np.concatenate([np.diff(np.asarray(p.doc_offsets)) for p in parts])
        tok = parts[0].load_tokenizer()
        manifest = {
            **base_manifest(tok, parts[0].dtype, parts[0].data_format),
            "num_tokens": sum(p.num_tokens for p in parts),
            "num_docs": sum(p.num_docs for p in parts),
            "shards": shards,
            "sources": [s for p in parts for s in p.manifest.get("sources", [])],
            "part": None,
            "merged_from": [str(p.path) for p in parts],
            "chat_template": parts[0].manifest.get("chat_template"),
            "doc_tokens": {"min": int(lengths.min()), "max": int(lengths.max()), "mean": float(lengths.mean())},
            "replaced_chars_total": sum(p.manifest.get("replaced_chars_total", 0) for p in parts),
            "checksums": {c.name: sha256_file(c) for c in copied},
            "created_by": f"fitlm {__version__}",
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        return manifest

    return atomic_dir(out_dir, write)
