"""Duplicate detection for `fitlm data clean`: exact (hash of normalised text) and near (MinHash LSH).

Shingles are character n-grams per line (`fitlm.data.prep.shingles`: n = 5 in spaced scripts, 3 in Chinese,
Japanese, Thai, ...), so text written without spaces deduplicates as well as English does, and lines
reordered or boilerplate lines added keep the shingles of the rest. Why our own numpy MinHash rather
than datasketch: hashing is vectorised per document (no Python loop per shingle), the hash is a fixed
function (splitmix64), so results do not depend on PYTHONHASHSEED or library versions, and it adds no
dependency.

Rule (the same in the local and the Ray engine, so both keep the same documents): a document is a
near duplicate if it shares an LSH bucket with an *earlier* document (input order) whose signature
agrees with its own in at least `threshold` × num_perm positions (estimated Jaccard >= threshold). The
first document of every group of copies is therefore kept, whichever engine or partitioning runs.
Bands × rows are chosen recall-first: at the threshold, a pair shares a bucket with probability
>= 0.99; among such splits, the one with the fewest candidates below the threshold.

Memory (local engine): 16 bytes per document (exact) and num_perm × 4 bytes + bands × 8 per document
(near), in this process; `--engine ray` spreads both over a cluster.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata

import numpy as np

from fitlm.data.prep.shingles import shingle_hashes, splitmix64

DEFAULT_JACCARD = 0.6
DEFAULT_NUM_PERM = 256
MIN_BUCKET_RECALL = 0.99
_WS = re.compile(r"\s+")


def normalise_for_match(text: str) -> str:
    """The text that exact duplicates are judged on: NFKC, casefolded, whitespace runs as one space."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def exact_key(text: str) -> bytes:
    """16-byte digest of the normalised text (blake2b: fast, collisions negligible)."""
    return hashlib.blake2b(normalise_for_match(text).encode("utf-8"), digest_size=16).digest()


def bucket_probability(s: np.ndarray | float, bands: int, rows: int) -> np.ndarray | float:
    """Probability that two sets of Jaccard s share at least one of `bands` buckets of `rows` rows."""
    return 1.0 - (1.0 - np.asarray(s, dtype=float) ** rows) ** bands


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows), bands × rows <= num_perm: P(bucket | s = threshold) >= MIN_BUCKET_RECALL, and the
    least false-candidate area below the threshold; if no split reaches that recall, the most recall."""
    s = np.linspace(0.0, threshold, 201)
    best, best_key = (num_perm, 1), None
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        recall = float(bucket_probability(threshold, bands, rows))
        fp = float(np.trapezoid(bucket_probability(s, bands, rows), s))
        key = (recall < MIN_BUCKET_RECALL, fp if recall >= MIN_BUCKET_RECALL else -recall)
        if best_key is None or key < best_key:
            best, best_key = (bands, rows), key
    return best


class MinHasher:
    """Signatures and LSH bucket keys; a plain picklable object, so Ray workers compute what this process would."""

    def __init__(
        self,
        threshold: float = DEFAULT_JACCARD,
        num_perm: int = DEFAULT_NUM_PERM,
        ngram: int | None = None,
        seed: int = 1,
    ):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"Jaccard threshold must be in (0, 1], got {threshold}")
        if num_perm < 2 or (ngram is not None and ngram < 1):
            raise ValueError("num_perm must be >= 2 and ngram >= 1")
        self.threshold, self.num_perm, self.ngram = threshold, num_perm, ngram
        self.bands, self.rows = lsh_params(threshold, num_perm)
        # Signature positions that must agree: an integer, so both engines decide identically.
        self.need = math.ceil(threshold * num_perm - 1e-9)
        # Multiply-shift hash family h_i(x) = (a_i * x + b_i) mod 2^64, high 32 bits (a_i odd): one
        # multiply-add per shingle and permutation; the shingle hashes are already well mixed.
        self._a = splitmix64(np.arange(num_perm, dtype=np.uint64) + np.uint64(seed << 20)) | np.uint64(1)
        self._b = splitmix64(self._a)
        self._band_seed = splitmix64(np.arange(self.bands, dtype=np.uint64) + np.uint64(0xBA9D))

    def signature(self, text: str) -> np.ndarray:
        """num_perm minimum hashes (uint32) of the text's shingles under num_perm hash functions."""
        sh = shingle_hashes(text, self.ngram)
        if sh.size == 0:
            return np.zeros(self.num_perm, np.uint32)
        sig = np.empty(self.num_perm, np.uint64)
        step = max(1, (1 << 20) // max(1, sh.size))  # bound the [perms, shingles] temporary to ~8 MB
        with np.errstate(over="ignore"):
            for i in range(0, self.num_perm, step):
                a, b = self._a[i : i + step, None], self._b[i : i + step, None]
                sig[i : i + step] = ((a * sh[None, :] + b) >> np.uint64(32)).min(axis=1)
        return sig.astype(np.uint32)

    def bucket_keys(self, sig: np.ndarray) -> np.ndarray:
        """One 64-bit key per band (a hash of the band index and its rows); equal keys = same bucket."""
        rows = sig[: self.bands * self.rows].reshape(self.bands, self.rows).astype(np.uint64)
        h = self._band_seed.copy()
        for j in range(self.rows):
            h = splitmix64(h ^ rows[:, j])
        return h

    def similar(self, earlier: np.ndarray, sig: np.ndarray) -> np.ndarray:
        """For signatures `earlier` [k, num_perm]: which agree with `sig` in >= threshold of positions."""
        return (earlier == sig[None, :]).sum(axis=1) >= self.need


class MinHashLSH(MinHasher):
    """Streaming near-duplicate filter: `seen(text)` is True if an earlier text (kept or not) shares a
    bucket with it and agrees in >= threshold of signature positions. Every text's signature is stored."""

    def __init__(
        self,
        threshold: float = DEFAULT_JACCARD,
        num_perm: int = DEFAULT_NUM_PERM,
        ngram: int | None = None,
        seed: int = 1,
    ):
        super().__init__(threshold, num_perm, ngram, seed)
        self._tables: list[dict[int, list[int]]] = [{} for _ in range(self.bands)]
        self._sigs: list[np.ndarray] = []
        self.candidates = 0  # pairs verified (how selective the banding is)

    def seen(self, text: str) -> bool:
        sig = self.signature(text)
        keys = self.bucket_keys(sig).tolist()
        found = sorted({c for t, k in zip(self._tables, keys) for c in t.get(k, ())})
        self.candidates += len(found)
        dup = bool(found) and bool(self.similar(np.stack([self._sigs[c] for c in found]), sig).any())
        idx = len(self._sigs)
        self._sigs.append(sig)
        for t, k in zip(self._tables, keys):
            t.setdefault(k, []).append(idx)
        return dup

    def __len__(self) -> int:
        return len(self._sigs)


def jaccard(a: str, b: str, ngram: int | None = None) -> float:
    """Exact Jaccard similarity of the two texts' shingle sets (for tests and reports)."""
    x, y = shingle_hashes(a, ngram), shingle_hashes(b, ngram)
    if x.size == 0 and y.size == 0:
        return 1.0
    return len(np.intersect1d(x, y)) / len(np.union1d(x, y))


__all__ = [
    "DEFAULT_JACCARD",
    "DEFAULT_NUM_PERM",
    "MinHashLSH",
    "MinHasher",
    "bucket_probability",
    "exact_key",
    "jaccard",
    "lsh_params",
    "normalise_for_match",
    "shingle_hashes",
]
