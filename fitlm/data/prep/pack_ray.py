"""`fitlm data pack --engine ray`: read and tokenize on Ray Data; the driver writes the shards.

Reading runs the local readers, one task per file (`fitlm.data.prep.ray_read`); at most `workers` tokenizer
tasks at a time, each process loading the tokenizer once, encode batches with the local engine's own encoder
(`encode.encode_batch`), so the ids are the same. Batches come back in input order (Ray Data's
preserve_order), and the driver appends them to the shards: the same files and token count as the local
engine. Only token ids (2-4 bytes per token) reach the driver; the text stays on the workers.
The tokenizer file must be readable at the same path on every node of a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fitlm.data.prep.ray_read import add_replaced, read_rows
from fitlm.data.prep.ray_session import ray_session, reraise_data_error
from fitlm.data.prep.sources import ReadStats, Split

_BATCH_ROWS = 512  # documents per encode call, as the local engine's batches


_LOADED: dict[str, Any] = {}


def _encode(
    batch: dict[str, np.ndarray],
    init: tuple[str, dict[str, str | None], tuple[str, str] | None],  # init_encoder's arguments
    chat: bool,
    max_length: int | None,
    overlong: str,
) -> dict[str, np.ndarray]:
    """One output row per input batch. A task, not an actor: actors would hold CPUs the read tasks need
    (on 2 CPUs, 2 actors starve the readers). Ray reuses worker processes, so the tokenizer is loaded once
    per process, keyed by its arguments."""
    from fitlm.data.prep.encode import encode_batch, init_encoder

    key = repr(init)
    if _LOADED.get("key") != key:
        init_encoder(*init, True)
        _LOADED["key"] = key
    texts = [t for t in batch["text"] if t]
    items = [json.loads(t) for t in texts] if chat else texts
    enc = encode_batch(items, max_length, overlong) if items else None
    replaced = batch["replaced"] > 0
    row: dict[str, Any] = {
        # One row per batch: ragged arrays travel as 1-element object columns.
        "ids": _one(enc["ids"] if enc else np.zeros(0, np.int64)),
        "lengths": _one(enc["lengths"] if enc else np.zeros(0, np.int64)),
        "mask": _one(enc.get("mask", np.zeros(0, np.uint8)) if enc else np.zeros(0, np.uint8)),
        "nbytes": np.array([int(batch["nbytes"].sum())], np.int64),
        "items": np.array([len(items)], np.int64),
        "replaced_gidx": _one(np.asarray(batch["gidx"][replaced], np.int64)),
        "replaced_n": _one(np.asarray(batch["replaced"][replaced], np.int64)),
    }
    for k in ("no_assistant", "truncated", "dropped_overlong"):
        row[k] = np.array([enc["counts"][k] if enc else 0], np.int64)
    return row


def _one(a: np.ndarray) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = a
    return out


def encode_on_ray(
    files: Sequence[Path],
    split: Split,
    min_doc_chars: int,
    chat: bool,
    init: tuple,
    max_length: int | None,
    overlong: str,
    workers: int,
    stats: ReadStats,
    counts: dict[str, int],
    advance: Callable[[int], None],
    address: str | None,
    show_progress: bool,
) -> Iterator[dict]:
    """Encoded batches of `files` in input order, as `pack._encoded` yields them on the local engine."""
    with ray_session(address, show_progress) as ray:
        try:
            ds = read_rows(ray, files, split, min_doc_chars, chat).map_batches(
                _encode,
                batch_size=_BATCH_ROWS,
                batch_format="numpy",
                concurrency=workers,
                fn_kwargs={"init": init, "chat": chat, "max_length": max_length, "overlong": overlong},
            )
            for b in ds.iter_batches(batch_size=1, batch_format="numpy"):
                advance(int(b["nbytes"][0]))
                for g, n in zip(b["replaced_gidx"][0].tolist(), b["replaced_n"][0].tolist()):
                    add_replaced(stats, files, g, n)
                if chat:
                    counts["conversations"] += int(b["items"][0])
                enc = {
                    "ids": np.asarray(b["ids"][0], np.int64),
                    "lengths": np.asarray(b["lengths"][0], np.int64),
                    "counts": {k: int(b[k][0]) for k in ("no_assistant", "truncated", "dropped_overlong")},
                }
                if chat:
                    enc["mask"] = np.asarray(b["mask"][0], np.uint8)
                yield enc
        except Exception as e:
            reraise_data_error(e)
            raise


__all__ = ["encode_on_ray"]
