"""`fitlm data clean`: stream documents through normalisation, quality filters and deduplication.

Order (cheap first, so expensive steps see fewer documents): Unicode NFKC and control-character removal
-> too short -> garbled -> symbols -> letters -> repetition -> code / boilerplate (optional) -> exact
duplicate -> near duplicate. Every measure counts characters, never words, so text written without
spaces (Chinese, Japanese, Thai) is judged like any other. Output: `clean-00000.jsonl`, ... ({"text"}
per line) and `report.json` with the count per filter; the directory appears atomically.
"""

from __future__ import annotations

import json
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fitlm import __version__
from fitlm.data.dedup import MinHashLSH, exact_key
from fitlm.data.errors import DataError
from fitlm.data.pack import _Progress, atomic_dir, check_out_dir
from fitlm.data.sources import DEFAULT_MIN_DOC_CHARS, ReadStats, Split, expand_inputs, iter_documents

DOCS_PER_FILE = 100_000
FILTERS = ("too_short", "garbled", "symbols", "few_letters", "repetition", "code", "boilerplate",
           "exact_duplicate", "near_duplicate")
_BOILERPLATE = re.compile(
    r"(cookie|javascript|all rights reserved|terms of (use|service)|privacy policy|click here|subscribe|sign in|"
    r"log ?in|newsletter|copyright ©|版权所有|隐私政策|登录|注册|免责声明|点击这里|关注我们)", re.IGNORECASE)
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import|#include|public |private |function |var |let |const |return\b|"
    r"if\s*\(|for\s*\(|while\s*\(|[}{;]\s*$|//|/\*|\*/|<\?php|<div|</)|[;{}]\s*$")


@dataclass
class CleanOptions:
    """Thresholds (each a flag of `fitlm data clean`). Ratios are fractions of characters."""

    normalize: str = "NFKC"          # Unicode normal form ("none" keeps the text as read)
    min_chars: int = 50              # drop documents shorter than this (after normalisation)
    max_garbled: float = 0.01        # drop if more than this share is U+FFFD, private-use or unassigned
    max_symbols: float = 0.3         # drop if more than this share is punctuation/symbols
    min_letters: float = 0.4         # drop if fewer than this share are letters (any script) or digits
    max_dup_lines: float = 0.3       # repetition: share of characters in lines seen earlier in the document
    min_compress: float = 0.2        # repetition: zlib size / size below this = highly repetitive
    drop_code: bool = False          # drop documents whose lines mostly look like source code
    max_code_lines: float = 0.5
    drop_boilerplate: bool = False   # remove boilerplate lines; drop documents that are mostly boilerplate
    max_boilerplate: float = 0.5
    exact_dedup: bool = True
    near_dedup: bool = True
    jaccard: float = 0.8             # near duplicate: estimated Jaccard of character 5-gram sets >= this
    num_perm: int = 128
    ngram: int = 5


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
    if _dup_line_share(lines) > o.max_dup_lines or (len(raw) >= 200 and len(zlib.compress(raw)) / len(raw) < o.min_compress):
        return "repetition", text
    nonblank = [ln for ln in lines if ln.strip()]
    if o.drop_code and nonblank and sum(bool(_CODE_LINE.search(ln)) for ln in nonblank) / len(nonblank) > o.max_code_lines:
        return "code", text
    if o.drop_boilerplate and nonblank:
        boiler = [bool(_BOILERPLATE.search(ln)) and len(ln) < 200 for ln in lines]
        if sum(boiler) / len(nonblank) > o.max_boilerplate:
            return "boilerplate", text
        text = "\n".join(ln for ln, b in zip(lines, boiler) if not b)
        if len(text.strip()) < o.min_chars:
            return "boilerplate", text
    return None, text


def clean_corpus(inputs: Sequence[Path | str], out_dir: Path | str, options: CleanOptions | None = None,
                 split: Split = "blank-lines", min_doc_chars: int = DEFAULT_MIN_DOC_CHARS,
                 show_progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Clean `inputs` into `out_dir` (jsonl files + report.json); return the report."""
    o = options or CleanOptions()
    if o.normalize not in ("NFKC", "NFC", "none"):
        raise DataError(f"--normalize {o.normalize!r} is not known; use NFKC (default), NFC or none")
    if not 0.0 < o.jaccard <= 1.0:
        raise DataError(f"--jaccard {o.jaccard} must be in (0, 1]; 0.8 is a common choice")
    if not inputs:
        raise DataError("no inputs to clean: pass one or more .txt/.jsonl/.parquet files or directories")
    files = expand_inputs(inputs)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, files, overwrite)

    def write(tmp: Path) -> dict:
        stats = ReadStats()
        dropped = dict.fromkeys(FILTERS, 0)
        n_in = kept = chars_in = chars_out = controls = normalized = 0
        exact: set[bytes] = set()
        lsh = MinHashLSH(o.jaccard, o.num_perm, o.ngram) if o.near_dedup else None
        outputs: list[str] = []
        out_f = None
        with _Progress(show_progress, sum(f.stat().st_size for f in files), "cleaning") as advance:
            for doc in iter_documents(files, split, min_doc_chars, stats):
                advance(doc.nbytes)
                if not doc.text:
                    continue
                n_in += 1
                chars_in += len(doc.text)
                text = doc.text
                if o.normalize != "none":
                    norm = unicodedata.normalize(o.normalize, text)
                    normalized += norm != text
                    text = norm
                text, removed = _strip_controls(text, Counter(text))
                controls += removed
                reason, text = check_document(text, o)
                if reason is None and o.exact_dedup:
                    key = exact_key(text)
                    if key in exact:
                        reason = "exact_duplicate"
                    exact.add(key)
                if reason is None and lsh is not None and lsh.seen(text):
                    reason = "near_duplicate"
                if reason is not None:
                    dropped[reason] += 1
                    continue
                if out_f is None or kept % DOCS_PER_FILE == 0:
                    if out_f is not None:
                        out_f.close()
                    outputs.append(f"clean-{len(outputs):05d}.jsonl")
                    out_f = open(tmp / outputs[-1], "w", encoding="utf-8")
                out_f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                kept += 1
                chars_out += len(text)
        if out_f is not None:
            out_f.close()
        report = {"inputs": [str(f) for f in files], "documents_in": n_in, "documents_out": kept,
                  "chars_in": chars_in, "chars_out": chars_out, "dropped": dropped,
                  "replaced_invalid_utf8": sum(stats.replaced.values()), "replaced_by_file": stats.replaced,
                  "control_chars_removed": controls, "documents_normalized": normalized, "files": outputs,
                  "options": asdict(o), "created_by": f"fitlm {__version__}"}
        if kept == 0:
            why = ", ".join(f"{k}={v}" for k, v in dropped.items() if v) or "no text in the input"
            raise DataError(f"empty after cleaning: all {n_in} document(s) of {', '.join(map(str, files))} were "
                            f"removed ({why}); loosen the thresholds (e.g. --min-chars, --min-letters) or check "
                            "the input")
        (tmp / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return report

    return atomic_dir(out_dir, write)


__all__ = ["CleanOptions", "FILTERS", "check_document", "clean_corpus"]
