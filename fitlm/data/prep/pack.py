"""Packer: text (.txt / .jsonl / .parquet), chat (.jsonl `messages`) or preference pairs (.jsonl `prompt`,
`chosen`, `rejected`: fitlm.data.preference) -> a sharded packed directory.

The format is documented in `fitlm.data.format`. Each document is stored as BOS doc EOS, BOS only when
the model's tokenizer adds one (fitlm's own tokenizers do; Qwen's does not); chat: the rendered
conversation, with a loss mask beside it. Documents never span shards; a shard closes once it
holds `shard_tokens` tokens. Tokenization runs in `workers` processes, in order, so the output is the
same for any worker count. `shard_index`/`num_shards` pack every n-th input file (one machine's part);
`fitlm data merge` joins the parts. The directory appears atomically (temporary sibling, then rename);
a full disk removes the temporary directory, keeps any previous output and says how much space is needed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fitlm import __version__
from fitlm.data.errors import DataError
from fitlm.data.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    OFFSETS_FILE,
    TOKENS_FILE,
    sha256_file,
    shard_files,
    token_dtype,
)
from fitlm.data.preference import MANIFEST_KEY, Pair
from fitlm.data.prep.encode import encode_batch, init_encoder
from fitlm.data.prep.output import Progress, atomic_dir, base_manifest, check_out_dir
from fitlm.data.prep.pack_options import DEFAULT_SHARD_TOKENS, PackOptions
from fitlm.data.prep.sources import (
    DEFAULT_MIN_DOC_CHARS,
    Document,
    ReadStats,
    expand_inputs,
    iter_chat,
    iter_documents,
    iter_preference,
)
from fitlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

# Encode this much text per batch: large enough to amortise process hand-off, small enough that one
# batch's ids never dominate memory.
_BATCH_DOCS = 512
_BATCH_CHARS = 1 << 20


def _batches(items: Iterator[tuple[Any, int]], advance: Callable[[int], None]) -> Iterator[list[Any]]:
    batch: list[Any] = []
    chars = 0
    for item, nbytes in items:
        advance(nbytes)
        if not item:
            continue
        batch.append(item)
        chars += (
            len(item)
            if isinstance(item, str)
            else item.chars()
            if isinstance(item, Pair)
            else sum(len(m["content"]) for m in item)
        )
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded(
    batches: Iterator[list[Any]], workers: int, init_args: tuple, max_length: int | None, overlong: str
) -> Iterator[dict[str, Any]]:
    """Encoded batches in input order; at most 2 × workers batches in flight (bounded memory)."""
    if workers <= 1:
        init_encoder(*init_args)
        for b in batches:
            yield encode_batch(b, max_length, overlong)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=init_encoder, initargs=(*init_args, True)) as pool:
        pending: deque = deque()
        for b in batches:
            pending.append(pool.apply_async(encode_batch, (b, max_length, overlong)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --------------------------------------------------------------------------- writing


class ShardWriter:
    """Appends documents to shard files, closing a shard once it holds `shard_tokens` tokens."""

    def __init__(self, root: Path, dtype: np.dtype, chat: bool, shard_tokens: int, first_index: int = 0):
        self.root, self.dtype, self.chat, self.shard_tokens = root, dtype, chat, shard_tokens
        self.index = first_index
        self.entries: list[dict[str, Any]] = []
        self._open = False

    def _start(self) -> None:
        self.files = shard_files(self.index, self.chat)
        self._tok_f = open(self.root / self.files["tokens"], "wb")
        self._mask_f = open(self.root / self.files["mask"], "wb") if self.chat else None
        self._hash = {"tokens": hashlib.sha256(), "mask": hashlib.sha256()}
        self._offsets = [0]
        self._open = True

    def add(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        """Write documents (flat ids split by lengths) to the current shard, rolling over between documents."""
        at = 0
        for n in lengths.tolist():
            if not self._open:
                self._start()
            data = ids[at : at + n].astype(self.dtype).tobytes()
            self._tok_f.write(data)
            self._hash["tokens"].update(data)
            if self.chat:
                assert mask is not None and self._mask_f is not None  # (chat data: a mask, and its file open)
                m = mask[at : at + n].tobytes()
                self._mask_f.write(m)
                self._hash["mask"].update(m)
            self._offsets.append(self._offsets[-1] + n)
            at += n
            if self._offsets[-1] >= self.shard_tokens:
                self._close()

    def _close(self) -> None:
        self._tok_f.close()
        if self._mask_f:
            self._mask_f.close()
        np.save(self.root / self.files["offsets"], np.asarray(self._offsets, dtype=np.int64))
        checks = {
            self.files["tokens"]: self._hash["tokens"].hexdigest(),
            self.files["offsets"]: sha256_file(self.root / self.files["offsets"]),
        }
        if self.chat:
            checks[self.files["mask"]] = self._hash["mask"].hexdigest()
        self.entries.append(
            {
                "name": self.files["tokens"].split(".")[0],
                "num_tokens": self._offsets[-1],
                "num_docs": len(self._offsets) - 1,
                "files": dict(self.files),
                "checksums": checks,
            }
        )
        self.index += 1
        self._open = False

    def finish(self) -> list[dict[str, Any]]:
        if self._open:
            self._close()
        return self.entries

    def abort(self) -> None:
        """Close the open shard files after a failed write, quietly: their buffered bytes cannot be written
        either (a full disk), and the caller deletes them."""
        if not self._open:
            return
        for f in (self._tok_f, self._mask_f):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._open = False


# What an empty pack holds none of, by data format.
EMPTY = {
    "preference": "no preference pair within --max-length",
    "chat": "no conversation with an assistant turn",
    "text": "no text (only whitespace or nothing)",
}


def pack_corpus(
    inputs: Sequence[Path | str],
    tokenizer_path: Path | str,
    out_dir: Path | str,
    options: PackOptions | None = None,
    **flags: Any,
) -> dict:
    """Tokenize `inputs` into a packed directory at `out_dir`; return its manifest. `options` (or the same
    fields as keywords, e.g. `show_progress=False`, `data_format="chat"`): see PackOptions."""
    opts = replace(options or PackOptions(), **flags)
    opts.check()
    if not inputs:
        raise DataError("no inputs to pack: pass one or more .txt/.jsonl/.parquet files or directories")
    files, part = opts.part_of(expand_inputs(inputs))
    out = Path(out_dir)
    check_out_dir(out, files, opts.overwrite)
    job = _Pack(opts, files, part, Tokenizer.from_file(tokenizer_path))
    return atomic_dir(out, job.write, "fitlm data pack", job.needed)


class _Pack:
    """One pack: the inputs read in order (by format), encoded (by engine), written in shards, then the manifest.

    It counts what the disk-full estimate needs (`needed`) as it goes: input bytes read, and the tokens and
    documents encoded from the first `done` of them."""

    def __init__(self, opts: PackOptions, files: list[Path], part: dict[str, Any] | None, tok: Tokenizer):
        self.opts, self.files, self.part, self.tok = opts, files, part, tok
        self.dtype = token_dtype(tok.vocab_size)
        self.tmpl = None
        if opts.chat:
            from fitlm.data.chat import ChatEncoder, resolve_template

            self.tmpl = resolve_template(opts.template, tok.path)
            ChatEncoder(tok, self.tmpl[1], self.tmpl[0])  # compile errors surface here, before any worker starts
        self.input_bytes = sum(f.stat().st_size for f in files)
        self.seen = {"read": 0, "done": 0, "tokens": 0, "docs": 0}
        self.marks: deque[int] = deque()  # input bytes read up to the end of each batch handed to the encoder
        self.stats = ReadStats()
        self.counts = (
            {"pairs": 0, "dropped_overlong": 0}
            if opts.preference
            else {"no_assistant": 0, "truncated": 0, "dropped_overlong": 0, "conversations": 0}
        )

    def needed(self) -> int:
        """Bytes the whole pack needs: tokens (+ mask bytes, + an int64 offset per document) encoded so far,
        scaled from the input they came from to all of it; before any, one token per input byte at most."""
        seen, per_token = self.seen, self.dtype.itemsize + self.opts.chat
        if seen["done"] and seen["tokens"]:
            data = self.input_bytes / seen["done"] * (seen["tokens"] * per_token + seen["docs"] * 8)
        else:
            data = self.input_bytes * per_token
        return int(data) + self.tok.path.stat().st_size + 16 * 1024  # + tokenizer, manifest

    def write(self, tmp: Path) -> dict:
        writer = ShardWriter(tmp, self.dtype, self.opts.chat, self.opts.shard_tokens)
        try:
            with Progress(self.opts.show_progress, self.input_bytes) as bar:
                for enc in self.encoded(bar):
                    for k, v in enc["counts"].items():
                        self.counts[k] += v
                    self.seen["tokens"] += len(enc["ids"])
                    self.seen["docs"] += len(enc["lengths"])
                    writer.add(enc["ids"], enc["lengths"], enc.get("mask"))
            shards = writer.finish()
        except BaseException:
            writer.abort()
            raise
        return self.manifest(tmp, shards)

    def encoded(self, bar: Callable[[int], None]) -> Iterator[dict[str, Any]]:
        """Encoded batches in input order, from the engine the options name."""

        def advance(n: int) -> None:
            self.seen["read"] += n
            bar(n)

        o, init = self.opts, (str(self.tok.path), self.tok.special_tokens, self.tmpl)
        if o.engine == "ray":
            from fitlm.data.prep.pack_ray import encode_on_ray

            for enc in encode_on_ray(
                self.files, o.split, o.min_doc_chars, o.chat, init, o.max_length, o.overlong, o.workers,
                self.stats, self.counts, advance, o.ray_address, o.show_progress,
            ):  # fmt: skip
                self.seen["done"] = self.seen["read"]
                yield enc
            return
        for enc in _encoded(self.marked(_batches(self.source(), advance)), o.workers, init, o.max_length, o.overlong):
            self.seen["done"] = self.marks.popleft()
            yield enc

    def marked(self, batches: Iterator[list[Any]]) -> Iterator[list[Any]]:
        for b in batches:
            self.marks.append(self.seen["read"])
            yield b

    def source(self) -> Iterator[tuple[Any, int]]:
        """(item, its input bytes): a preference pair, a conversation or a document's text, by data format."""
        if self.opts.preference:
            yield from iter_preference(self.files, self.stats)
        elif self.opts.chat:
            for m, n in iter_chat(self.files, self.stats):
                self.counts["conversations"] += m is not None
                yield m, n
        else:
            docs = iter_documents(self.files, self.opts.split, self.opts.min_doc_chars, self.stats)
            yield from ((d.text, d.nbytes) for d in docs)

    def manifest(self, tmp: Path, shards: list[dict[str, Any]]) -> dict:
        o, chat = self.opts, self.opts.chat
        num_docs = sum(s["num_docs"] for s in shards)
        if num_docs == 0:
            names = ", ".join(str(f) for f in self.files)
            what = EMPTY["preference" if o.preference else "chat" if chat else "text"]
            raise DataError(f"empty corpus: {names} contain(s) {what}; pass files that hold the data to pack")
        copied = self.tok.copy_to(tmp)
        lengths = np.concatenate([np.diff(np.load(tmp / s["files"]["offsets"])) for s in shards])
        counts, stats = self.counts, self.stats
        manifest = {
            **base_manifest(self.tok, self.dtype, "chat" if chat else o.data_format),
            "num_tokens": int(lengths.sum()),
            "num_docs": num_docs,
            "shards": shards,
            "sources": [str(f) for f in self.files],
            "part": self.part,
            "split": o.split if not chat else None,
            "min_doc_chars": o.min_doc_chars if o.split == "blank-lines" and not chat else None,
            "engine": o.engine,
            "chat_template": self.tmpl[0] if self.tmpl else None,
            "chat": (
                {**counts, "max_length": o.max_length, "overlong": o.overlong} if chat and not o.preference else None
            ),
            **({MANIFEST_KEY: {**counts, "max_length": o.max_length}} if o.preference else {}),
            "doc_tokens": {"min": int(lengths.min()), "max": int(lengths.max()), "mean": float(lengths.mean())},
            "replaced_chars_total": sum(stats.replaced.values()),
            "replaced_chars": stats.replaced,
            "checksums": {p.name: sha256_file(p) for p in copied},
            "created_by": f"fitlm {__version__}",
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        return manifest


__all__ = [
    "DEFAULT_MIN_DOC_CHARS",
    "DEFAULT_SHARD_TOKENS",
    "Document",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "OFFSETS_FILE",
    "ReadStats",
    "ShardWriter",
    "TOKENIZER_FILE",
    "TOKENS_FILE",
    "atomic_dir",
    "base_manifest",
    "check_out_dir",
    "expand_inputs",
    "iter_documents",
    "PackOptions",
    "pack_corpus",
    "sha256_file",
    "token_dtype",
]
