"""`fitlm data inspect`: what a packed directory holds, at a glance."""

from __future__ import annotations

from pathlib import Path

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


def inspect_packed(path: Path, sample_tokens: int = 48) -> dict:
    ds = PackedDataset(path)
    lengths = np.diff(np.asarray(ds.doc_offsets))
    tok = ds.load_tokenizer()
    first = ds.document(0)[:sample_tokens].tolist() if ds.num_docs else []
    return {
        "path": str(path), "format_version": ds.manifest["format_version"], "dtype": str(ds.dtype),
        "num_tokens": ds.num_tokens, "num_docs": ds.num_docs, "vocab_size": ds.vocab_size,
        "tokenizer_sha256": ds.tokenizer_sha256,
        "doc_tokens_mean": round(float(lengths.mean()), 1) if lengths.size else 0.0,
        "doc_tokens_max": int(lengths.max()) if lengths.size else 0,
        "length_histogram": length_histogram(lengths),
        "sample_token_ids": first, "sample_text": tok.decode(first),
    }
