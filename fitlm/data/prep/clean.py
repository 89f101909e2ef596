"""`fitlm data clean`: stream documents through normalisation, quality filters and deduplication.

Order (cheap first, so expensive steps see fewer documents): Unicode NFKC and control-character removal
-> too short -> garbled -> symbols -> letters -> repetition -> code / boilerplate (optional) -> exact
duplicate -> near duplicate (`fitlm.data.prep.dedup`: a copy of an earlier document, in input order). Every measure
counts characters, never words, so text written without
spaces (Chinese, Japanese, Thai) is judged like any other. Output: `clean-00000.jsonl`, ... ({"text"}
per line) and `report.json` with the count per filter; the directory appears atomically. `--engine ray`
(fitlm.data.prep.clean_ray) runs the same per-document steps and the same duplicate rule on Ray Data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitlm.data.errors import DataError
from fitlm.data.prep.clean_filters import (
    FILTERS,
    CleanOptions,
    CleanWriter,
    Tally,
    check_document,
    check_options,
    prepare_document,
    write_report,
)
from fitlm.data.prep.dedup import MinHashLSH, exact_key
from fitlm.data.prep.output import Progress, atomic_dir, check_out_dir
from fitlm.data.prep.ray_session import check_engine
from fitlm.data.prep.sources import DEFAULT_MIN_DOC_CHARS, ReadStats, Split, check_split, expand_inputs, iter_documents


def clean_corpus(
    inputs: Sequence[Path | str],
    out_dir: Path | str,
    options: CleanOptions | None = None,
    split: Split = "blank-lines",
    min_doc_chars: int = DEFAULT_MIN_DOC_CHARS,
    show_progress: bool = True,
    overwrite: bool = False,
    engine: str = "local",
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Clean `inputs` into `out_dir` (jsonl files + report.json); return the report.

    engine "ray" runs the same steps on Ray Data (fitlm.data.prep.clean_ray) and keeps the same documents."""
    o = options or CleanOptions()
    check_options(o)
    check_engine(engine)
    if not inputs:
        raise DataError("no inputs to clean: pass one or more .txt/.jsonl/.parquet files or directories")
    files = expand_inputs(inputs)
    check_split(split)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, files, overwrite)
    if engine == "ray":
        from fitlm.data.prep.clean_ray import clean_on_ray

        return atomic_dir(
            out_dir, lambda tmp: clean_on_ray(files, tmp, o, split, min_doc_chars, show_progress, ray_address)
        )

    def write(tmp: Path) -> dict:
        stats = ReadStats()
        tally = Tally()
        exact: set[bytes] = set()
        lsh = MinHashLSH(o.jaccard, o.num_perm, o.ngram) if o.near_dedup else None
        out = CleanWriter(tmp)
        try:
            with Progress(show_progress, sum(f.stat().st_size for f in files), "cleaning") as advance:
                for doc in iter_documents(files, split, min_doc_chars, stats):
                    advance(doc.nbytes)
                    if not doc.text:
                        continue
                    reason, text, normalized, removed = prepare_document(doc.text, o)
                    if reason is None and o.exact_dedup:
                        key = exact_key(text)
                        if key in exact:
                            reason = "exact_duplicate"
                        exact.add(key)
                    if reason is None and lsh is not None and lsh.seen(text):
                        reason = "near_duplicate"
                    tally.add(len(doc.text), reason, text, normalized, removed)
                    if reason is None:
                        out.write(text)
        finally:
            out.close()
        return write_report(tmp, tally.report(files, stats, out.files, o, "local"))

    return atomic_dir(out_dir, write)


__all__ = [
    "CleanOptions",
    "CleanWriter",
    "FILTERS",
    "Tally",
    "check_document",
    "check_options",
    "clean_corpus",
    "prepare_document",
    "write_report",
]
