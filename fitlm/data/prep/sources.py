"""Input readers: .txt (one document per file, per blank-line block or per line), .jsonl (a `text`
field, or `messages` for chat), .parquet (a `text` column; needs the optional pyarrow extra); .txt and
.jsonl may be gzip-compressed (.txt.gz, .jsonl.gz). Everything streams: a corpus is never loaded whole,
and bad UTF-8 is replaced with U+FFFD and counted, never fatal.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fitlm.data.chat import check_messages
from fitlm.data.errors import DataError
from fitlm.data.preference import PAIR_EXAMPLE, Pair, check_pair

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_MIN_DOC_CHARS = 2000
Split = Literal["blank-lines", "file", "line"]
SPLITS = ("blank-lines", "file", "line")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(
            f"--split {split!r} is not known; use 'blank-lines' (default), 'file' or 'line' (one document per line)"
        )


def input_kind(path: Path) -> str:
    """The reader a file needs, from its suffix without .gz: ".txt", ".jsonl", ".parquet" (else the suffix)."""
    suffixes = [x.lower() for x in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _is_input(path: Path) -> bool:
    kind = input_kind(path)
    if path.suffix.lower() == ".gz":
        return kind in TEXT_SUFFIXES + JSONL_SUFFIXES
    return kind in TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


def expand_inputs(inputs: Sequence[Path | str]) -> list[Path]:
    """Files named directly, plus every .txt/.jsonl/.parquet (and .txt.gz/.jsonl.gz) file under named
    directories (sorted, no duplicates)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and _is_input(f) and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise DataError(
                    f"input directory {p} holds no .txt, .jsonl or .parquet files; put the corpus there "
                    "or name the files directly"
                )
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"input {p} does not exist; pass existing .txt/.jsonl/.parquet files or directories")
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


@dataclass
class Document:
    text: str
    source: int  # index into the list of files
    nbytes: int  # raw bytes consumed since the previous document (drives the progress bar)


@dataclass
class ReadStats:
    """What reading found besides text: undecodable bytes that were replaced with U+FFFD, per file."""

    replaced: dict[str, int] = field(default_factory=dict)

    def add_replaced(self, path: Path, n: int) -> None:
        if n > 0:
            self.replaced[str(path)] = self.replaced.get(str(path), 0) + n


def _iter_lines(path: Path, stats: ReadStats) -> Iterator[tuple[str, int]]:
    """(line, raw byte length) pairs. Bad UTF-8 is replaced and counted, never fatal."""
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rb") as f:
        for i, raw in enumerate(f):
            data = raw[3:] if i == 0 and raw.startswith(b"\xef\xbb\xbf") else raw  # drop a UTF-8 BOM
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError:
                line = data.decode("utf-8", errors="replace")
                # Each invalid sequence becomes one U+FFFD; genuine U+FFFD characters (EF BF BD) are not errors.
                stats.add_replaced(path, line.count("\ufffd") - data.count(b"\xef\xbf\xbd"))
            if line.endswith("\r\n"):
                line = line[:-2] + "\n"
            yield line, len(raw)


def _split_text(lines: Iterator[tuple[str, int]], min_chars: float) -> Iterator[tuple[str, int]]:
    """Group blank-line separated blocks into documents of at least `min_chars` non-blank characters.

    A document ends at the first blank line after it has reached `min_chars`; blank lines inside it are
    kept, leading blank lines and trailing whitespace are dropped. min_chars=inf gives one document.
    """
    doc: list[str] = []
    size = 0
    nbytes = 0
    for line, n in lines:
        nbytes += n
        if line.strip():
            doc.append(line)
            size += len(line)
        elif size >= min_chars:
            yield "".join(doc).rstrip(), nbytes
            doc, size, nbytes = [], 0, 0
        elif doc:
            doc.append(line)
    if size:
        yield "".join(doc).rstrip(), nbytes
    elif nbytes:
        yield "", nbytes  # only whitespace left: report the bytes, the caller skips the empty text


def iter_jsonl_records(path: Path, stats: ReadStats, what: str = '"text" field') -> Iterator[tuple[Any, int, int]]:
    """(record or None for a blank line, raw bytes, line number) per line of a .jsonl file."""
    for lineno, (line, n) in enumerate(_iter_lines(path, stats), start=1):
        if not line.strip():
            yield None, n, lineno
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: not valid JSON ({e.msg} column {e.colno}); each line of a .jsonl "
                f"file must be one JSON object with a {what}"
            ) from None
        yield record, n, lineno


def _iter_jsonl(path: Path, stats: ReadStats) -> Iterator[tuple[str, int]]:
    """One document per JSON line, taken from its "text" field (or the contents of its "messages")."""
    for record, n, lineno in iter_jsonl_records(path, stats):
        if record is None:
            yield "", n
            continue
        text = record.get("text") if isinstance(record, dict) else None
        if text is None and isinstance(record, dict) and isinstance(record.get("messages"), list):
            # Chat records: their contents are text too (e.g. to train a tokenizer on chat data).
            text = "\n".join(
                m["content"] for m in record["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str)
            )
        if not isinstance(text, str):
            raise DataError(
                f'{path}:{lineno}: no string "text" field; each line of a .jsonl file must be '
                'a JSON object like {"text": "..."}'
            )
        yield text, n


def iter_documents(
    files: Sequence[Path],
    split: Split = "blank-lines",
    min_doc_chars: int = DEFAULT_MIN_DOC_CHARS,
    stats: ReadStats | None = None,
) -> Iterator[Document]:
    """Stream the documents of `files` in order, skipping empty ones.

    .jsonl: one document per line; .parquet: one per row of its `text` column. Text files: `split="file"` makes
    each file one document; `split="line"` each line (review and web-text dumps); `split="blank-lines"`
    groups blank-line separated blocks until a document has `min_doc_chars`.
    """
    check_split(split)
    stats = stats if stats is not None else ReadStats()
    for index, path in enumerate(files):
        yield from iter_file_documents(path, index, split, min_doc_chars, stats)


def iter_file_documents(
    path: Path, index: int, split: Split, min_doc_chars: int, stats: ReadStats
) -> Iterator[Document]:
    """The documents of one file (`index` is its place in the input list): what each engine's reader runs."""
    kind = input_kind(path)
    if kind in JSONL_SUFFIXES:
        pieces = _iter_jsonl(path, stats)
    elif kind in PARQUET_SUFFIXES:
        pieces = iter_parquet(path, "text")
    elif split == "line":
        pieces = ((line.rstrip("\n"), n) for line, n in _iter_lines(path, stats))
    else:
        min_chars = float("inf") if split == "file" else max(0, min_doc_chars)
        pieces = _split_text(_iter_lines(path, stats), min_chars)
    pending = 0
    for text, nbytes in pieces:
        pending += nbytes
        if text.strip():
            yield Document(text, index, pending)
            pending = 0
    if pending:
        yield Document("", index, pending)  # lets progress reach 100%; empty docs are never packed


def _require_pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet needs pyarrow, which is not installed; "
            "`pip install 'fitlm[data]'` (or `pip install pyarrow`), or convert the file to .jsonl"
        ) from None
    return pq


def iter_parquet(path: Path, column: str) -> Iterator[tuple[Any, int]]:
    """(value, approximate bytes) per row of `column`, read one record batch at a time."""
    pq = _require_pyarrow(path)
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for a non-parquet file
        raise DataError(f"{path} is not a readable parquet file ({e}); pass a valid .parquet file") from None
    if column not in f.schema_arrow.names:
        raise DataError(
            f"{path} has no {column!r} column (columns: {', '.join(f.schema_arrow.names)}); "
            f"store the documents in a column named {column!r}"
        )
    total = path.stat().st_size
    rows = max(1, f.metadata.num_rows)
    for batch in f.iter_batches(columns=[column], batch_size=1024):
        values = batch.column(0).to_pylist()
        for v in values:
            yield v if v is not None else "", max(1, total // rows)


def iter_chat(files: Sequence[Path], stats: ReadStats) -> Iterator[tuple[Any, int]]:
    """(validated messages or None, raw bytes) per line of chat .jsonl files."""
    for path in files:
        if input_kind(path) not in JSONL_SUFFIXES:
            raise DataError(f'{path}: chat data must be .jsonl with one {{"messages": [...]}} object per line')
        for record, n, lineno in iter_jsonl_records(path, stats, what='"messages" list'):
            if record is None:
                yield None, n
                continue
            if not isinstance(record, dict) or "messages" not in record:
                raise DataError(
                    f'{path}:{lineno}: no "messages" field; each line of chat data must be '
                    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}'
                )
            yield check_messages(record["messages"], f"{path}:{lineno}"), n


def iter_preference(files: Sequence[Path], stats: ReadStats) -> Iterator[tuple[Pair | None, int]]:
    """(validated pair or None, raw bytes) per line of preference .jsonl files."""
    for path in files:
        if input_kind(path) not in JSONL_SUFFIXES:
            raise DataError(f"{path}: preference data must be .jsonl with one {PAIR_EXAMPLE} object per line")
        for record, n, lineno in iter_jsonl_records(path, stats, what='"prompt"/"chosen"/"rejected" object'):
            yield (None if record is None else check_pair(record, f"{path}:{lineno}")), n


__all__ = [
    "DEFAULT_MIN_DOC_CHARS",
    "Document",
    "JSONL_SUFFIXES",
    "PARQUET_SUFFIXES",
    "ReadStats",
    "SPLITS",
    "Split",
    "TEXT_SUFFIXES",
    "check_split",
    "expand_inputs",
    "input_kind",
    "iter_documents",
    "iter_file_documents",
    "iter_chat",
    "iter_jsonl_records",
    "iter_parquet",
    "iter_preference",
]
