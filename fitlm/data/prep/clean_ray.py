"""`fitlm data clean --engine ray`: the local engine's steps on Ray Data, deduplicating across all partitions.

1. read (one task per file, the local readers) -> per-document normalisation and filters
   (`clean_filters.prepare_document`), exact key and MinHash signature, in parallel;
2. exact: group by key; every member but the first in input order is an exact duplicate;
3. near: one row per (LSH bucket, document); group by bucket -> candidate pairs (earlier, later);
   group by the earlier, then by the later document to bring both signatures together -> a later document agreeing
   with an earlier one in >= threshold of positions
   is a near duplicate (the rule of `fitlm.data.prep.dedup`, so the same documents go as on the local engine);
4. the driver streams the prepared documents in input order and writes the kept ones, the same files
   and report as the local engine.

Memory on the driver: the sets of duplicate document ids (8 bytes per duplicate); the documents
themselves stay in Ray's object store, which spills to disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fitlm.data.prep.clean_filters import CleanOptions, CleanWriter, Tally, prepare_document, write_report
from fitlm.data.prep.dedup import MinHasher, exact_key
from fitlm.data.prep.ray_read import add_replaced, read_rows
from fitlm.data.prep.ray_session import ray_session, reraise_data_error
from fitlm.data.prep.sources import ReadStats, Split


def _prepare(batch: dict[str, np.ndarray], o: CleanOptions, hasher: MinHasher | None) -> dict[str, np.ndarray]:
    out: dict[str, Any] = {
        "reason": [],
        "clean": [],
        "normalized": [],
        "controls": [],
        "key": [],
        "has_sig": [],
        "sig": [],
    }
    width = hasher.num_perm if hasher is not None else 1
    zeros = np.zeros(width, np.uint32)
    for raw in batch["text"]:
        reason, text, normalized, removed = prepare_document(raw, o) if raw else ("", "", False, 0)
        passed = bool(raw) and reason is None
        out["reason"].append(reason or "")
        out["clean"].append(text)
        out["normalized"].append(normalized)
        out["controls"].append(removed)
        out["key"].append(exact_key(text).hex() if passed and o.exact_dedup else "")
        out["has_sig"].append(passed and hasher is not None)
        out["sig"].append(hasher.signature(text) if passed and hasher is not None else zeros)
    # Signatures travel as a [n, num_perm] uint32 tensor column (bytes columns may come back as numpy
    # fixed-width bytes, which drop trailing zero bytes).
    cols = {k: np.asarray(v, dtype=object if k in ("reason", "clean", "key") else None) for k, v in out.items()}
    cols["sig"] = np.stack(out["sig"]) if out["sig"] else np.zeros((0, width), np.uint32)
    return {
        "gidx": batch["gidx"],
        "raw_chars": np.array([len(t) for t in batch["text"]], np.int64),
        "nbytes": batch["nbytes"],
        "replaced": batch["replaced"],
        **cols,
    }


# Every group-by below groups by a *slice* of the key space (key mod `slices`), and each UDF call
# handles one slice with numpy: a UDF call has a fixed cost in Ray, which, paid per bucket or per document
# (num_bands rows each), made the dedup much slower than the local engine.


def slices_for(rows: int) -> int:
    """Key slices (= shuffle partitions) of a group-by: one per ~1M rows, 2..1024."""
    return max(2, min(1024, rows // 1_000_000 + 1))


def _sliced(keys: np.ndarray, slices: int) -> np.ndarray:
    return (keys.astype(np.int64) % slices).astype(np.int64)


def _exact_rows(batch: dict[str, np.ndarray], slices: int) -> dict[str, np.ndarray]:
    has = batch["key"] != ""
    keys = batch["key"][has]
    head = np.array([int(k[:15], 16) for k in keys], np.int64)  # 60 bits of the digest pick the slice
    return {"slice": _sliced(head, slices), "key": keys, "gidx": batch["gidx"][has]}


def _later_members(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Exact duplicates in one slice: every document but the first (input order) of each key."""
    order = np.argsort(group["gidx"], kind="stable")
    keys, ids = group["key"][order], group["gidx"][order]
    _, first = np.unique(keys.astype(str), return_index=True)
    keep = np.zeros(len(ids), bool)
    keep[first] = True
    return {"gidx": ids[~keep]}


def _bucket_rows(batch: dict[str, np.ndarray], hasher: MinHasher, slices: int) -> dict[str, np.ndarray]:
    keys = [hasher.bucket_keys(sig).view(np.int64) for sig in batch["sig"]]
    bucket = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    gidx = np.repeat(np.asarray(batch["gidx"], np.int64), hasher.bands)
    return {"slice": _sliced(bucket, slices), "bucket": bucket, "gidx": gidx}


def _pairs(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """(earlier, later) for every pair of documents sharing a bucket, in one slice of buckets."""
    order = np.lexsort((group["gidx"], group["bucket"]))
    bucket, gidx = group["bucket"][order], group["gidx"][order]
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    sizes = np.diff(np.r_[starts, len(bucket)])
    a, b = [], []
    for start, size in zip(starts[sizes > 1].tolist(), sizes[sizes > 1].tolist()):
        g = np.unique(gidx[start : start + size])
        i, j = np.triu_indices(len(g), k=1)
        a.append(g[i])
        b.append(g[j])
    empty = np.zeros(0, np.int64)
    return {"a": np.concatenate(a) if a else empty, "b": np.concatenate(b) if b else empty}


def _sig_rows(batch: dict[str, np.ndarray], slices: int) -> dict[str, np.ndarray]:
    n = len(batch["gidx"])
    return {
        "slice": _sliced(batch["gidx"], slices),
        "key": batch["gidx"],
        "other": np.full(n, -1, np.int64),
        "sig": batch["sig"],
    }


def _pair_rows(batch: dict[str, np.ndarray], width: int, slices: int) -> dict[str, np.ndarray]:
    return {
        "slice": _sliced(batch["a"], slices),
        "key": batch["a"],
        "other": batch["b"],
        "sig": np.zeros((len(batch["a"]), width), np.uint32),
    }


def _lookup(group: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pair rows' positions, their keys, the signature each key's own row carries)."""
    own = group["other"] == -1
    own_keys, own_sigs = group["key"][own], group["sig"][own]
    order = np.argsort(own_keys)
    own_keys, own_sigs = own_keys[order], own_sigs[order]
    rows = np.flatnonzero(~own)
    at = np.searchsorted(own_keys, group["key"][rows])
    return rows, at, own_sigs


def _send_signature(group: dict[str, np.ndarray], slices: int) -> dict[str, np.ndarray]:
    """A slice of earlier documents: each pair (earlier, later) becomes (later, earlier's signature)."""
    rows, at, own_sigs = _lookup(group)
    later = group["other"][rows]
    return {"slice": _sliced(later, slices), "key": later, "other": group["key"][rows], "sig": own_sigs[at]}


def _near_duplicates_in(group: dict[str, np.ndarray], need: int) -> dict[str, np.ndarray]:
    """A slice of later documents: those agreeing with an earlier candidate in >= `need` positions."""
    rows, at, own_sigs = _lookup(group)
    if len(rows) == 0:
        return {"gidx": np.zeros(0, np.int64)}
    same = (group["sig"][rows] == own_sigs[at]).sum(axis=1) >= need
    return {"gidx": np.unique(group["key"][rows][same])}


def _ids(ds: Any) -> np.ndarray:
    parts = [b["gidx"] for b in ds.iter_batches(batch_format="numpy", batch_size=65536)]
    return np.unique(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, np.int64)


def _keep(batch: dict[str, np.ndarray], drop: np.ndarray) -> dict[str, np.ndarray]:
    mask = batch["has_sig"].astype(bool) & ~np.isin(batch["gidx"], drop)
    return {"gidx": batch["gidx"][mask], "sig": batch["sig"][mask]}


def _group(ds: Any, partitions: int, fn: Any, **kwargs: Any) -> Any:
    return ds.groupby("slice", num_partitions=partitions).map_groups(fn, batch_format="numpy", fn_kwargs=kwargs)


def _exact_duplicates(prepared: Any) -> np.ndarray:
    slices = slices_for(prepared.count())
    keys = prepared.map_batches(_exact_rows, batch_format="numpy", fn_kwargs={"slices": slices})
    return _ids(_group(keys, slices, _later_members))


def _near_duplicates(ray: Any, prepared: Any, exact_drop: np.ndarray, hasher: MinHasher) -> np.ndarray:
    sigs = prepared.map_batches(_keep, batch_format="numpy", fn_kwargs={"drop": ray.put(exact_drop)}).materialize()
    n = sigs.count()
    if n == 0:
        return np.zeros(0, np.int64)
    slices = slices_for(n * hasher.bands)
    buckets = sigs.map_batches(_bucket_rows, batch_format="numpy", fn_kwargs={"hasher": hasher, "slices": slices})
    pairs = _group(buckets, slices, _pairs).materialize()
    if pairs.count() == 0:
        return np.zeros(0, np.int64)
    # A join as two group-bys (Ray's own join needs polars): pairs meet the earlier signature, then the later one.
    own = sigs.map_batches(_sig_rows, batch_format="numpy", fn_kwargs={"slices": slices})
    asks = pairs.map_batches(_pair_rows, batch_format="numpy", fn_kwargs={"width": hasher.num_perm, "slices": slices})
    sent = _group(own.union(asks), slices, _send_signature, slices=slices)
    return _ids(_group(own.union(sent), slices, _near_duplicates_in, need=hasher.need))


def clean_on_ray(
    files: Sequence[Path],
    tmp: Path,
    o: CleanOptions,
    split: Split,
    min_doc_chars: int,
    show_progress: bool,
    address: str | None,
) -> dict[str, Any]:
    """Write the cleaned corpus of `files` into `tmp` (called inside the atomic output directory)."""
    hasher = MinHasher(o.jaccard, o.num_perm, o.ngram) if o.near_dedup else None
    with ray_session(address, show_progress) as ray:
        try:
            prepared = (
                read_rows(ray, files, split, min_doc_chars)
                .map_batches(_prepare, batch_format="numpy", fn_kwargs={"o": o, "hasher": hasher})
                .materialize()
            )
            exact_drop = _exact_duplicates(prepared) if o.exact_dedup else np.zeros(0, np.int64)
            near_drop = (
                _near_duplicates(ray, prepared, exact_drop, hasher) if hasher is not None else np.zeros(0, np.int64)
            )
            stats, tally, out = ReadStats(), Tally(), CleanWriter(tmp)
            try:
                for b in prepared.iter_batches(batch_format="numpy", batch_size=4096):
                    is_exact = np.isin(b["gidx"], exact_drop)
                    is_near = np.isin(b["gidx"], near_drop)
                    for k in range(len(b["gidx"])):
                        add_replaced(stats, files, int(b["gidx"][k]), b["replaced"][k])
                        if not b["raw_chars"][k]:
                            continue
                        reason = b["reason"][k] or (
                            "exact_duplicate" if is_exact[k] else "near_duplicate" if is_near[k] else None
                        )
                        tally.add(
                            int(b["raw_chars"][k]),
                            reason,
                            b["clean"][k],
                            bool(b["normalized"][k]),
                            int(b["controls"][k]),
                        )
                        if reason is None:
                            out.write(b["clean"][k])
            finally:
                out.close()
        except Exception as e:
            reraise_data_error(e)
            raise
    return write_report(tmp, tally.report(files, stats, out.files, o, "ray"))


__all__ = ["clean_on_ray"]
