"""Packer: raw text (.txt / .jsonl) -> a versioned directory of token ids that `PackedDataset` memory-maps.

On-disk format, version 1 (everything a reader needs is in manifest.json):

    tokens.bin        flat token stream, `dtype` (uint16 when the vocabulary fits, else uint32),
                      each document stored as BOS doc EOS, documents back to back
    doc_offsets.npy   int64[num_docs + 1]: start of each document in tokens.bin, then the end
    tokenizer.json    byte-for-byte copy of the tokenizer used (+ tokenizer_config.json if it had one)
    manifest.json     {"format": "fitlm-packed", "format_version": 1, dtype, num_tokens, num_docs,
                       vocab_size, tokenizer_sha256, bos_id, eos_id, pad_id, sources, checksums, ...}

The directory appears atomically: it is written under a temporary sibling name and renamed at the end.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from fitlm import __version__
from fitlm.data.errors import DataError
from fitlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

FORMAT = "fitlm-packed"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.npy"
MANIFEST_FILE = "manifest.json"

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
DEFAULT_MIN_DOC_CHARS = 2000
Split = Literal["blank-lines", "file"]

# Encode this much text per encode_batch call: large enough to use tokenizers' threads, small enough
# that one batch's ids never dominate memory.
_BATCH_DOCS = 512
_BATCH_CHARS = 1 << 20


# --------------------------------------------------------------------------- reading text


def expand_inputs(inputs: Sequence[Path | str]) -> list[Path]:
    """Files named directly, plus every .txt/.jsonl file under named directories (sorted, no duplicates)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise DataError(f"input directory {p} holds no .txt or .jsonl files; put the corpus there "
                                "or name the files directly")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"input {p} does not exist; pass existing .txt/.jsonl files or directories")
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
    with open(path, "rb") as f:
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


def _iter_jsonl(path: Path, stats: ReadStats) -> Iterator[tuple[str, int]]:
    """One document per JSON line, taken from its "text" field."""
    for lineno, (line, n) in enumerate(_iter_lines(path, stats), start=1):
        if not line.strip():
            yield "", n
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line of a .jsonl file must be one "
                            'JSON object with a "text" field') from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f'{path}:{lineno}: no string "text" field; each line of a .jsonl file must be '
                            'a JSON object like {"text": "..."}')
        yield text, n


def iter_documents(files: Sequence[Path], split: Split = "blank-lines", min_doc_chars: int = DEFAULT_MIN_DOC_CHARS,
                   stats: ReadStats | None = None) -> Iterator[Document]:
    """Stream the documents of `files` in order, skipping empty ones.

    .jsonl: one document per line. Text files: `split="file"` makes each file one document;
    `split="blank-lines"` groups blank-line separated blocks until a document has `min_doc_chars`.
    """
    if split not in ("blank-lines", "file"):
        raise DataError(f"--split {split!r} is not known; use 'blank-lines' (default) or 'file'")
    stats = stats if stats is not None else ReadStats()
    for index, path in enumerate(files):
        if path.suffix.lower() in JSONL_SUFFIXES:
            pieces = _iter_jsonl(path, stats)
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


# --------------------------------------------------------------------------- writing


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 .. vocab_size-1) fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _check_out_dir(out_dir: Path, files: list[Path], overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {out_dir} exists and is not a directory; choose a directory path for --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise DataError(f"output directory {out_dir} is not empty; choose a new or empty directory, "
                        "or pass --overwrite to replace its contents")
    root = out_dir.resolve()
    for f in files:
        if root in f.resolve().parents:
            raise DataError(f"input {f} lies inside the output directory {out_dir}; "
                            "write the packed data somewhere else")




class _Progress:
    """A rich progress bar over input bytes, on stderr (stdout is reserved for --json output)."""

    def __init__(self, enabled: bool, total: int):
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)
            self._bar = Progress(TextColumn("packing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                 TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task("packing", total=total)

    def __enter__(self) -> Callable[[int], None]:
        if self._bar is None:
            return lambda n: None
        self._bar.__enter__()
        return lambda n: self._bar.advance(self._task, n)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def pack_corpus(
    inputs: Sequence[Path | str],
    tokenizer_path: Path | str,
    out_dir: Path | str,
    split: Split = "blank-lines",
    show_progress: bool = True,
    overwrite: bool = False,
    min_doc_chars: int = DEFAULT_MIN_DOC_CHARS,
) -> dict:
    """Tokenize `inputs` into a packed-data directory at `out_dir`; return its manifest.

    Text is streamed and encoded in batches; only one batch of ids is in memory at a time. Nothing is
    written to `out_dir` unless packing succeeds.
    """
    if split not in ("blank-lines", "file"):
        raise DataError(f"--split {split!r} is not known; use 'blank-lines' (default) or 'file'")
    if not inputs:
        raise DataError("no inputs to pack: pass one or more .txt/.jsonl files or directories")
    files = expand_inputs(inputs)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, files, overwrite)
    tok = Tokenizer.from_file(tokenizer_path)
    dtype = token_dtype(tok.vocab_size)

    created = [p for p in [out_dir.parent, *out_dir.parent.parents] if not p.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.packing-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        stats = ReadStats()
        offsets = array("q", [0])
        tokens_hash = hashlib.sha256()
        with open(tmp / TOKENS_FILE, "wb") as out, _Progress(show_progress, sum(f.stat().st_size for f in files)) as advance:

            def flush(batch: list[str]) -> None:
                ids = tok.encode_batch(batch, add_bos=True, add_eos=True)
                for seq in ids:
                    offsets.append(offsets[-1] + len(seq))
                count = sum(len(seq) for seq in ids)
                data = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=count).tobytes()
                out.write(data)
                tokens_hash.update(data)

            batch: list[str] = []
            chars = 0
            for doc in iter_documents(files, split, min_doc_chars, stats):
                advance(doc.nbytes)
                if not doc.text:
                    continue
                batch.append(doc.text)
                chars += len(doc.text)
                if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                    flush(batch)
                    batch, chars = [], 0
            if batch:
                flush(batch)

        num_docs = len(offsets) - 1
        if num_docs == 0:
            names = ", ".join(str(f) for f in files)
            raise DataError(f"empty corpus: {names} contain(s) no text (only whitespace or nothing); "
                            "pass files that hold the text to pack")
        offs = np.frombuffer(offsets, dtype=np.int64)
        np.save(tmp / OFFSETS_FILE, offs)
        copied = tok.copy_to(tmp)
        lengths = np.diff(offs)
        checksums = {TOKENS_FILE: tokens_hash.hexdigest(), OFFSETS_FILE: sha256_file(tmp / OFFSETS_FILE)}
        checksums.update({p.name: sha256_file(p) for p in copied})
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": dtype.name,
            "num_tokens": int(offs[-1]),
            "num_docs": num_docs,
            "vocab_size": tok.vocab_size,
            "tokenizer_sha256": tok.sha256,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
            "special_tokens": tok.special_tokens,
            "sources": [str(f) for f in files],
            "split": split,
            "min_doc_chars": min_doc_chars if split == "blank-lines" else None,
            "doc_tokens": {"min": int(lengths.min()), "max": int(lengths.max()), "mean": float(lengths.mean())},
            "replaced_chars_total": sum(stats.replaced.values()),
            "replaced_chars": stats.replaced,
            "checksums": checksums,
            "created_by": f"fitlm {__version__}",
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _commit(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # undo parent directories this call made, innermost first
            try:
                p.rmdir()
            except OSError:
                break
        raise
    return manifest


def _commit(tmp: Path, out_dir: Path) -> None:
    """Move the finished directory into place; an existing (empty or overwritten) one is swapped out first."""
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["FORMAT", "FORMAT_VERSION", "TOKENS_FILE", "OFFSETS_FILE", "MANIFEST_FILE", "TOKENIZER_FILE",
           "DEFAULT_MIN_DOC_CHARS", "Document", "ReadStats", "expand_inputs", "iter_documents", "pack_corpus",
           "sha256_file", "token_dtype"]
