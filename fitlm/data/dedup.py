"""Duplicate detection for `fitlm data clean`: exact (hash of normalised text) and near (MinHash LSH).

Shingles are *character* n-grams of the normalised text (casefolded, whitespace collapsed), so text
written without spaces (Chinese, Japanese, Thai) deduplicates as well as English does. Why our own
numpy MinHash rather than datasketch: hashing is vectorised per document (no Python loop per shingle),
the hash is a fixed function (splitmix64), so results do not depend on PYTHONHASHSEED or library
versions, and it adds no dependency (datasketch pulls in scipy). The LSH band/row split is chosen for
the requested Jaccard threshold the way datasketch does it: minimise the false-positive plus the
false-negative area under the S-curve. Candidates are confirmed by their estimated Jaccard, which keeps
false positives rare.

Memory: one 64-bit hash per kept document (exact) and num_perm × 4 bytes per kept document (near),
in this process. Shard the corpus (and dedup per shard) beyond what one machine holds.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np

_WS = re.compile(r"\s+")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def normalise_for_match(text: str) -> str:
    """The text that duplicates are judged on: NFKC, casefolded, whitespace runs as one space."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def exact_key(text: str) -> bytes:
    """16-byte digest of the normalised text (blake2b: fast, collisions negligible)."""
    return hashlib.blake2b(normalise_for_match(text).encode("utf-8"), digest_size=16).digest()


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def shingle_hashes(text: str, n: int = 5) -> np.ndarray:
    """Unique 64-bit hashes of the character n-grams of the normalised text (one hash if shorter than n)."""
    norm = normalise_for_match(text)
    cps = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    if cps.size == 0:
        return np.zeros(0, np.uint64)
    if cps.size < n:
        n = int(cps.size)
    count = cps.size - n + 1
    h = np.zeros(count, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):  # polynomial rolling hash, wrapping mod 2^64, then mixed
            h = h * np.uint64(1_000_003) + cps[j:j + count]
    return np.unique(_splitmix64(h))


def _s_curve_error(threshold: float, bands: int, rows: int) -> float:
    s = np.linspace(0.0, 1.0, 401)
    p = 1.0 - (1.0 - s ** rows) ** bands  # probability that two sets of Jaccard s share a band
    fp = np.trapezoid(np.where(s < threshold, p, 0.0), s)
    fn = np.trapezoid(np.where(s >= threshold, 1.0 - p, 0.0), s)
    return float(fp + fn)


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) with bands × rows <= num_perm minimising the S-curve's error around `threshold`."""
    best = (1, num_perm)
    err = float("inf")
    for bands in range(1, num_perm + 1):
        rows = num_perm // bands
        e = _s_curve_error(threshold, bands, rows)
        if e < err:
            best, err = (bands, rows), e
    return best


class MinHashLSH:
    """Streaming near-duplicate filter: `seen(text)` is True if an earlier kept text has estimated
    Jaccard similarity >= threshold (then the text is not stored), else it stores the text's signature."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 128, ngram: int = 5, seed: int = 1):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"Jaccard threshold must be in (0, 1], got {threshold}")
        if num_perm < 2 or ngram < 1:
            raise ValueError("num_perm must be >= 2 and ngram >= 1")
        self.threshold, self.num_perm, self.ngram = threshold, num_perm, ngram
        self.bands, self.rows = lsh_params(threshold, num_perm)
        # Multiply-shift hash family h_i(x) = (a_i * x + b_i) mod 2^64, high 32 bits (a_i odd): one
        # multiply-add per shingle and permutation; the shingle hashes are already well mixed.
        self._a = _splitmix64(np.arange(num_perm, dtype=np.uint64) + np.uint64(seed << 20)) | np.uint64(1)
        self._b = _splitmix64(self._a)
        self._tables: list[dict[bytes, list[int]]] = [{} for _ in range(self.bands)]
        self._sigs: list[np.ndarray] = []

    def signature(self, text: str) -> np.ndarray:
        """num_perm minimum hashes (uint32) of the text's shingles under num_perm hash functions."""
        sh = shingle_hashes(text, self.ngram)
        if sh.size == 0:
            return np.zeros(self.num_perm, np.uint32)
        sig = np.empty(self.num_perm, np.uint64)
        step = max(1, (1 << 20) // max(1, sh.size))  # bound the [perms, shingles] temporary to ~8 MB
        with np.errstate(over="ignore"):
            for i in range(0, self.num_perm, step):
                a, b = self._a[i:i + step, None], self._b[i:i + step, None]
                sig[i:i + step] = ((a * sh[None, :] + b) >> np.uint64(32)).min(axis=1)
        return sig.astype(np.uint32)

    def seen(self, text: str) -> bool:
        sig = self.signature(text)
        keys = [sig[b * self.rows:(b + 1) * self.rows].tobytes() for b in range(self.bands)]
        candidates = {c for t, k in zip(self._tables, keys) for c in t.get(k, ())}
        for c in candidates:
            if float(np.mean(self._sigs[c] == sig)) >= self.threshold:
                return True
        idx = len(self._sigs)
        self._sigs.append(sig)
        for t, k in zip(self._tables, keys):
            t.setdefault(k, []).append(idx)
        return False

    def __len__(self) -> int:
        return len(self._sigs)


def jaccard(a: str, b: str, ngram: int = 5) -> float:
    """Exact Jaccard similarity of the two texts' shingle sets (for tests and reports)."""
    x, y = shingle_hashes(a, ngram), shingle_hashes(b, ngram)
    if x.size == 0 and y.size == 0:
        return 1.0
    return len(np.intersect1d(x, y)) / len(np.union1d(x, y))


__all__ = ["MinHashLSH", "exact_key", "jaccard", "lsh_params", "normalise_for_match", "shingle_hashes"]
