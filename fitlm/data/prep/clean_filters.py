"""What one document goes through in `fitlm data clean`, on either engine: normalisation, the quality
filters, the per-filter tally, the output writer and the report (fitlm.data.prep.clean runs them locally,
fitlm.data.prep.clean_ray on Ray Data)."""

from __future__ import annotations

import json
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal, cast

from fitlm import __version__
from fitlm.data.errors import DataError
from fitlm.data.prep.dedup import DEFAULT_JACCARD, DEFAULT_NUM_PERM
from fitlm.data.prep.sources import ReadStats

DOCS_PER_FILE = 100_000
FILTERS = (
    "too_short",
    "garbled",
    "symbols",
    "few_letters",
    "repetition",
    "code",
    "boilerplate",
    "exact_duplicate",
    "near_duplicate",
)
_BOILERPLATE = re.compile(
    r"(cookie|javascript|all rights reserved|terms of (use|service)|privacy policy|click here|subscribe|sign in|"
    r"log ?in|newsletter|copyright ©|版权所有|隐私政策|登录|注册|免责声明|点击这里|关注我们)",
    re.IGNORECASE,
)
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import|#include|public |private |function |var |let |const |return\b|"
    r"if\s*\(|for\s*\(|while\s*\(|[}{;]\s*$|//|/\*|\*/|<\?php|<div|</)|[;{}]\s*$"
)


@dataclass
class CleanOptions:
    """Thresholds (each a flag of `fitlm data clean`). Ratios are fractions of characters."""

    normalize: str = "NFKC"  # Unicode normal form ("none" keeps the text as read)
    min_chars: int = 50  # drop documents shorter than this (after normalisation)
    max_garbled: float = 0.01  # drop if more than this share is U+FFFD, private-use or unassigned
    max_symbols: float = 0.3  # drop if more than this share is punctuation/symbols
    min_letters: float = 0.4  # drop if fewer than this share are letters (any script) or digits
    max_dup_lines: float = 0.3  # repetition: share of characters in lines seen earlier in the document
    min_compress: float = 0.2  # repetition: zlib size / size below this = highly repetitive
    drop_code: bool = False  # drop documents whose lines mostly look like source code
    max_code_lines: float = 0.5
    drop_boilerplate: bool = False  # remove boilerplate lines; drop documents that are mostly boilerplate
    max_boilerplate: float = 0.5
    exact_dedup: bool = True
    near_dedup: bool = True
    jaccard: float = DEFAULT_JACCARD  # near duplicate: estimated Jaccard of per-line character n-gram sets >= this
    num_perm: int = DEFAULT_NUM_PERM
    ngram: int | None = None  # None: by script (5 spaced, 3 Chinese/Japanese/Thai...; fitlm.data.prep.shingles)


def _strip_controls(text: str, chars: Counter[str]) -> tuple[str, int]:
    """Remove control/format characters except newline and tab; (text, removed count).
    `chars` is the text's character histogram: categories are looked up once per distinct character."""
    bad = {c: None for c in chars if c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf")}
    if not bad:
        return text, 0
    return text.translate({ord(c): None for c in bad}), sum(chars[c] for c in bad)


def _shares(text: str) -> tuple[float, float, float]:
    """(garbled, symbols, letters-or-digits) as shares of the non-space characters.

    Garbled = U+FFFD (undecodable bytes), private-use (Co) and unassigned (Cn) code points."""
    major: Counter[str] = Counter()
    garbled = 0
    for c, n in Counter(text).items():  # one category lookup per distinct character
        if c.isspace():
            continue
        cat = "X" if c == "\ufffd" else unicodedata.category(c)
        major[cat[0]] += n
        garbled += n if cat in ("X", "Co", "Cn") else 0
    total = max(1, sum(major.values()))
    return garbled / total, (major["P"] + major["S"]) / total, (major["L"] + major["N"]) / total


def _dup_line_share(lines: list[str]) -> float:
    seen: set[str] = set()
    dup = total = 0
    for line in lines:
        s = line.strip()
        if not s:
            continue
        total += len(s)
        if s in seen:
            dup += len(s)
        seen.add(s)
    return dup / total if total else 0.0


def check_document(text: str, o: CleanOptions) -> tuple[str | None, str]:
    """(reason it is dropped or None, the possibly edited text) for the quality filters (no dedup)."""
    if len(text.strip()) < o.min_chars:
        return "too_short", text
    garbled, symbols, letters = _shares(text)
    if garbled > o.max_garbled:
        return "garbled", text
    if symbols > o.max_symbols:
        return "symbols", text
    if letters < o.min_letters:
        return "few_letters", text
    lines = text.splitlines()
    raw = text.encode("utf-8")
    if _dup_line_share(lines) > o.max_dup_lines or (
        len(raw) >= 200 and len(zlib.compress(raw)) / len(raw) < o.min_compress
    ):
        return "repetition", text
    nonblank = [ln for ln in lines if ln.strip()]
    if (
        o.drop_code
        and nonblank
        and sum(bool(_CODE_LINE.search(ln)) for ln in nonblank) / len(nonblank) > o.max_code_lines
    ):
        return "code", text
    if o.drop_boilerplate and nonblank:
        boiler = [bool(_BOILERPLATE.search(ln)) and len(ln) < 200 for ln in lines]
        if sum(boiler) / len(nonblank) > o.max_boilerplate:
            return "boilerplate", text
        text = "\n".join(ln for ln, b in zip(lines, boiler) if not b)
        if len(text.strip()) < o.min_chars:
            return "boilerplate", text
    return None, text


def prepare_document(text: str, o: CleanOptions) -> tuple[str | None, str, bool, int]:
    """(reason it is dropped or None, cleaned text, whether normalisation changed it, control characters
    removed): everything before deduplication, for one document (the same in every engine)."""
    normalized = False
    if o.normalize != "none":
        norm = unicodedata.normalize(cast(Literal["NFKC", "NFC"], o.normalize), text)  # (check_options: one of these)
        normalized, text = norm != text, norm
    text, removed = _strip_controls(text, Counter(text))
    reason, text = check_document(text, o)
    return reason, text, normalized, removed


def check_options(o: CleanOptions) -> None:
    if o.normalize not in ("NFKC", "NFC", "none"):
        raise DataError(f"--normalize {o.normalize!r} is not known; use NFKC (default), NFC or none")
    if not 0.0 < o.jaccard <= 1.0:
        raise DataError(
            f"--jaccard {o.jaccard} must be in (0, 1]; {DEFAULT_JACCARD} (the default) finds copies "
            "with up to 3% of their characters edited"
        )
    if o.num_perm < 2:
        raise DataError(f"--num-perm {o.num_perm} must be at least 2; {DEFAULT_NUM_PERM} is the default")
    if o.ngram is not None and o.ngram < 1:
        raise DataError(
            f"--ngram {o.ngram} must be at least 1 (or left out: 5 for spaced scripts, 3 for Chinese, "
            "Japanese, Thai, ...)"
        )


class Tally:
    """The counts of report.json, added up document by document (either engine)."""

    def __init__(self) -> None:
        self.dropped = dict.fromkeys(FILTERS, 0)
        self.n_in = self.kept = self.chars_in = self.chars_out = self.controls = self.normalized = 0

    def add(self, raw_chars: int, reason: str | None, text: str, normalized: bool, controls: int) -> None:
        self.n_in += 1
        self.chars_in += raw_chars
        self.controls += controls
        self.normalized += normalized
        if reason is not None:
            self.dropped[reason] += 1
        else:
            self.kept += 1
            self.chars_out += len(text)

    def report(
        self, files: Sequence[Path], stats: ReadStats, outputs: list[str], o: CleanOptions, engine: str
    ) -> dict[str, Any]:
        if self.kept == 0:
            why = ", ".join(f"{k}={v}" for k, v in self.dropped.items() if v) or "no text in the input"
            raise DataError(
                f"empty after cleaning: all {self.n_in} document(s) of {', '.join(map(str, files))} were "
                f"removed ({why}); loosen the thresholds (e.g. --min-chars, --min-letters) or check "
                "the input"
            )
        return {
            "inputs": [str(f) for f in files],
            "documents_in": self.n_in,
            "documents_out": self.kept,
            "chars_in": self.chars_in,
            "chars_out": self.chars_out,
            "dropped": self.dropped,
            "replaced_invalid_utf8": sum(stats.replaced.values()),
            "replaced_by_file": stats.replaced,
            "control_chars_removed": self.controls,
            "documents_normalized": self.normalized,
            "files": outputs,
            "options": asdict(o),
            "engine": engine,
            "created_by": f"fitlm {__version__}",
        }


class CleanWriter:
    """clean-00000.jsonl, ... with DOCS_PER_FILE documents each, in the order they are given."""

    def __init__(self, root: Path):
        self.root, self.count = root, 0
        self.files: list[str] = []
        self._f: IO[str] | None = None

    def write(self, text: str) -> None:
        if self._f is None or self.count % DOCS_PER_FILE == 0:
            self.close()
            self.files.append(f"clean-{len(self.files):05d}.jsonl")
            self._f = open(self.root / self.files[-1], "w", encoding="utf-8")
        self._f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        self.count += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def write_report(tmp: Path, report: dict[str, Any]) -> dict[str, Any]:
    (tmp / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


__all__ = [
    "CleanOptions",
    "CleanWriter",
    "FILTERS",
    "Tally",
    "check_document",
    "check_options",
    "prepare_document",
    "write_report",
]
