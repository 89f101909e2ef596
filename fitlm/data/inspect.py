"""`fitlm data inspect`: what a packed directory holds, at a glance, with a decoded sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np

from fitlm.data.dataset import PackedDataset


def length_histogram(lengths: np.ndarray, bins: int = 8) -> list[dict]:
    """Document lengths in log-spaced bins (corpora span several orders of magnitude)."""
    if lengths.size == 0:
        return []
    lo, hi = max(1, int(lengths.min())), int(lengths.max()) + 1
    edges = np.unique(np.geomspace(lo, hi, bins + 1).astype(np.int64))
    counts, _ = np.histogram(lengths, bins=edges)
    return [{"min": int(a), "max": int(b) - 1, "count": int(c)} for a, b, c in zip(edges[:-1], edges[1:], counts)]


def inspect_packed(path: Path, sample_tokens: int = 64, sample_doc: int = 0, verify: bool = False) -> dict:
    """Summary of `path`; `sample_doc` is decoded (chat data: also its trained part, the assistant tokens)."""
    ds = PackedDataset(path)
    if verify:
        ds.verify()
    lengths = np.diff(np.asarray(ds.doc_offsets))
    tok = ds.load_tokenizer()
    doc = min(max(0, sample_doc), ds.num_docs - 1)
    ids = ds.document(doc)[:sample_tokens].tolist() if ds.num_docs else []
    report: dict[str, Any] = {
        "path": str(path),
        "format_version": ds.manifest["format_version"],
        "data_format": ds.data_format,
        "dtype": str(ds.dtype),
        "num_tokens": ds.num_tokens,
        "num_docs": ds.num_docs,
        "num_shards": len(ds.shards),
        "vocab_size": ds.vocab_size,
        "tokenizer_sha256": ds.tokenizer_sha256,
        "doc_tokens_mean": round(float(lengths.mean()), 1) if lengths.size else 0.0,
        "doc_tokens_max": int(lengths.max()) if lengths.size else 0,
        "length_histogram": length_histogram(lengths),
        "shards": [
            {"name": s.name, "num_tokens": int(len(s.tokens)), "num_docs": int(len(s.offsets) - 1)} for s in ds.shards
        ],
        "sample_doc": doc,
        "sample_token_ids": ids,
        "sample_text": tok.decode(ids, skip_special_tokens=False),
        "verified": verify,
    }
    if ds.data_format == "chat":
        full, mask = ds.document(doc), ds.document_mask(doc).astype(bool)
        report["sample_trained_text"] = tok.decode(full[mask].tolist(), skip_special_tokens=False)
        report["trained_token_share"] = round(
            float(sum(int(np.count_nonzero(cast(np.ndarray, s.mask))) for s in ds.shards)) / max(1, ds.num_tokens), 4
        )
        report["chat"] = ds.manifest.get("chat")
    return report
