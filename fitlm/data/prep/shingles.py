"""The shingles that near-duplicate detection compares: character n-grams per line, n chosen by script.

Why per line: a copy with its lines (paragraphs) reordered keeps every shingle, and boilerplate lines
added above or below add shingles without destroying any. Why n by script: one edited character
destroys up to n shingles, so a copy with a share e of its characters edited keeps about (1 - e)^n of
them; small n tolerates more edits but, in alphabetic text, makes distinct documents share common
n-grams ("the", "ing"). A character of Chinese or Japanese carries about as much as an English word, so
3-grams there are as selective as 5-grams in spaced scripts: with those, distinct documents of one domain
stay far below the dedup threshold and lightly edited copies far above it (bench/data.py; its shingle-kinds
table is in bench/RESULTS.md, "Data at corpus scale").
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

NGRAM_SPACED = 5  # Latin, Cyrillic, Greek, Arabic, Hangul, ...: words separated by spaces
NGRAM_UNSPACED = 3  # Han, kana, Thai, Lao, Khmer, Myanmar, Tibetan: no spaces between words
# Code point ranges of scripts written without spaces between words.
_UNSPACED = (
    (0x0E00, 0x0EFF),
    (0x0F00, 0x0FFF),
    (0x1000, 0x109F),
    (0x1780, 0x17FF),
    (0x3040, 0x30FF),
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0x20000, 0x3134F),
)
_WS = re.compile(r"[^\S\n]+")
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mixing function: results never depend on PYTHONHASHSEED or library versions."""
    with np.errstate(over="ignore"):
        x = x + _MIX[0]
        x = (x ^ (x >> np.uint64(30))) * _MIX[1]
        x = (x ^ (x >> np.uint64(27))) * _MIX[2]
        return x ^ (x >> np.uint64(31))


def normalise_lines(text: str) -> str:
    """NFKC, casefolded, runs of spaces/tabs as one space, blank lines and line-edge spaces removed."""
    lines = _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).split("\n")
    return "\n".join(s for s in (ln.strip() for ln in lines) if s)


def is_unspaced(text: str) -> bool:
    """True if most letters of `text` belong to scripts written without spaces between words."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    low = cps | np.uint32(0x20)  # ASCII letters, either case
    spaced = int(((low >= ord("a")) & (low <= ord("z")) & (cps < 0x80)).sum())
    in_unspaced = np.zeros(cps.shape, bool)
    for lo, hi in _UNSPACED:
        in_unspaced |= (cps >= lo) & (cps <= hi)
    values, counts = np.unique(cps[(cps > 0x7F) & ~in_unspaced], return_counts=True)
    spaced += sum(int(n) for v, n in zip(values.tolist(), counts.tolist()) if chr(v).isalpha())
    return int(in_unspaced.sum()) > spaced


def ngram_for(text: str, ngram: int | None = None) -> int:
    """The n-gram size for `text`: `ngram` if given, else by its script."""
    if ngram is not None:
        return ngram
    return NGRAM_UNSPACED if is_unspaced(text) else NGRAM_SPACED


def shingle_hashes(text: str, ngram: int | None = None) -> np.ndarray:
    """Unique 64-bit hashes of the character n-grams of each normalised line (a line shorter than n is
    one shingle). n: `ngram`, or by script (`ngram_for`)."""
    norm = normalise_lines(text)
    if not norm:
        return np.zeros(0, np.uint64)
    n = ngram_for(norm, ngram)
    cps = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    # Shingle i covers cps[i:i+n]; it is valid if it holds no newline, or if it is a whole short line.
    count = max(1, cps.size - n + 1)
    width = min(n, cps.size)
    h = np.zeros(count, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(width):  # polynomial rolling hash, wrapping mod 2^64, then mixed
            h = h * np.uint64(1_000_003) + cps[j : j + count]
    newline = np.concatenate([[0], np.cumsum(cps == 10)])
    starts = np.arange(count)
    crosses = newline[starts + width] - newline[starts] > 0
    keep = ~crosses
    short = _short_lines(norm, n)
    out = h[keep]
    if short:
        extra = np.array([hash_string(s) for s in short], dtype=np.uint64)
        out = np.concatenate([out, extra])
    return np.unique(splitmix64(out))


def _short_lines(norm: str, n: int) -> list[str]:
    """Lines shorter than n characters (they hold no full n-gram, but still count, as one shingle each)."""
    return [ln for ln in norm.split("\n") if len(ln) < n] if "\n" in norm else []


def hash_string(s: str) -> int:
    """A fixed 64-bit hash of a string (the low 8 bytes of blake2b)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


__all__ = [
    "NGRAM_SPACED",
    "NGRAM_UNSPACED",
    "hash_string",
    "is_unspaced",
    "ngram_for",
    "normalise_lines",
    "shingle_hashes",
    "splitmix64",
]
