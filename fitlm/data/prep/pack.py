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
from fitlm.data.prep.ray_session import check_engine
from fitlm.data.prep.sources import (
    DEFAULT_MIN_DOC_CHARS,
    Document,
    ReadStats,
    Split,
    check_split,
    expand_inputs,
    iter_chat,
    iter_documents,
    iter_preference,
)
from fitlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens: 512 MiB of uint16 per shard
OVERLONG = ("truncate", "drop")
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


def pack_corpus(
    inputs: Sequence[Path | str],
    tokenizer_path: Path | str,
    out_dir: Path | str,
    split: Split = "blank-lines",
    show_progress: bool = True,
    overwrite: bool = False,
    min_doc_chars: int = DEFAULT_MIN_DOC_CHARS,
    data_format: str = "text",
    template: str | None = None,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    shard_index: int | None = None,
    num_shards: int | None = None,
    max_length: int | None = None,
    overlong: str = "truncate",
    engine: str = "local",
    ray_address: str | None = None,
) -> dict:
    """Tokenize `inputs` into a packed directory at `out_dir`; return its manifest.

    data_format "chat": .jsonl conversations rendered with `template` (see fitlm.data.chat), loss mask on
    assistant tokens; samples without an assistant turn are skipped and counted; conversations longer than
    `max_length` tokens are truncated or dropped (`overlong`) and counted. data_format "preference": .jsonl
    (prompt, chosen, rejected) rows, two documents per pair (fitlm.data.preference); a pair with a sequence
    over `max_length` is dropped and counted. engine "ray": read and tokenize
    on Ray Data (fitlm.data.prep.pack_ray), `workers` tokenizer actors; the same shards as the local engine.
    """
    check_split(split)
    check_engine(engine)
    if data_format not in ("text", "chat", "preference"):
        raise DataError(f"--format {data_format!r} is not known; use text, chat or preference")
    preference = data_format == "preference"
    if preference and engine != "local":
        raise DataError("--format preference packs with --engine local only; drop --engine ray")
    if preference and (shard_index is not None or num_shards is not None):
        # `fitlm data merge` would join the parts as chat data, without the marker that keeps pairs for DPO
        raise DataError("--format preference packs in one part; drop --shard-index / --num-shards (use --workers)")
    if overlong not in OVERLONG:
        raise DataError(f"--overlong {overlong!r} is not known; use truncate or drop")
    if workers < 1 or shard_tokens < 1 or (max_length is not None and max_length < 2):
        raise DataError("--workers and --shard-tokens must be at least 1 and --max-length at least 2")
    if not inputs:
        raise DataError("no inputs to pack: pass one or more .txt/.jsonl/.parquet files or directories")
    files = expand_inputs(inputs)
    part = None
    if shard_index is not None or num_shards is not None:
        if shard_index is None or num_shards is None or not 0 <= shard_index < num_shards:
            raise DataError(
                f"--shard-index {shard_index} --num-shards {num_shards}: give both, with 0 <= shard-index < num-shards"
            )
        part = {"index": shard_index, "count": num_shards, "inputs_total": len(files)}
        files = files[shard_index::num_shards]
        if not files:
            raise DataError(
                f"part {shard_index} of {num_shards} gets no input file ({part['inputs_total']} inputs); "
                "use fewer --num-shards than input files"
            )
    out_dir = Path(out_dir)
    check_out_dir(out_dir, files, overwrite)
    tok = Tokenizer.from_file(tokenizer_path)
    dtype = token_dtype(tok.vocab_size)
    chat = data_format in ("chat", "preference")  # preference pairs are stored as chat documents with a mask
    tmpl = None
    if chat:
        from fitlm.data.chat import ChatEncoder, resolve_template

        tmpl = resolve_template(template, tok.path)
        ChatEncoder(tok, tmpl[1], tmpl[0])  # compile errors surface here, before any worker starts

    input_bytes = sum(f.stat().st_size for f in files)
    # For the disk-full estimate: input bytes read, and tokens/documents encoded from the first `done` of them.
    seen = {"read": 0, "done": 0, "tokens": 0, "docs": 0}
    marks: deque[int] = deque()  # input bytes read up to the end of each batch handed to the encoder

    def needed() -> int:
        """Bytes the whole pack needs: tokens (+ mask bytes, + an int64 offset per document) encoded so far,
        scaled from the input they came from to all of it; before any, one token per input byte at most."""
        per_token = dtype.itemsize + chat
        if seen["done"] and seen["tokens"]:
            scale = input_bytes / seen["done"]
            data = scale * (seen["tokens"] * per_token + seen["docs"] * 8)
        else:
            data = input_bytes * per_token
        return int(data) + tok.path.stat().st_size + 16 * 1024  # + tokenizer, manifest

    def marked(batches: Iterator[list[Any]]) -> Iterator[list[Any]]:
        for b in batches:
            marks.append(seen["read"])
            yield b

    def write(tmp: Path) -> dict:
        stats = ReadStats()
        counts = (
            {"pairs": 0, "dropped_overlong": 0}
            if preference
            else {"no_assistant": 0, "truncated": 0, "dropped_overlong": 0, "conversations": 0}
        )
        writer = ShardWriter(tmp, dtype, chat, shard_tokens)
        try:
            return _write(tmp, stats, counts, writer)
        except BaseException:
            writer.abort()
            raise

    def _write(tmp: Path, stats: ReadStats, counts: dict[str, int], writer: ShardWriter) -> dict:
        with Progress(show_progress, input_bytes) as bar:

            def advance(n: int) -> None:
                seen["read"] += n
                bar(n)

            source: Iterator[tuple[Any, int]]  # (item: a pair, a conversation or a text; its input bytes)
            if preference:
                source = iter_preference(files, stats)
            elif chat and engine == "local":

                def items() -> Iterator[tuple[Any, int]]:
                    for m, n in iter_chat(files, stats):
                        counts["conversations"] += m is not None
                        yield m, n

                source = items()
            else:
                source = ((d.text, d.nbytes) for d in iter_documents(files, split, min_doc_chars, stats))
            init = (str(tok.path), tok.special_tokens, tmpl)
            if engine == "ray":
                from fitlm.data.prep.pack_ray import encode_on_ray

                stream = encode_on_ray(
                    files,
                    split,
                    min_doc_chars,
                    chat,
                    init,
                    max_length,
                    overlong,
                    workers,
                    stats,
                    counts,
                    advance,
                    ray_address,
                    show_progress,
                )
            else:
                stream = _encoded(marked(_batches(source, advance)), workers, init, max_length, overlong)
            for enc in stream:
                for k, v in enc["counts"].items():
                    counts[k] += v
                seen["done"] = marks.popleft() if engine == "local" else seen["read"]
                seen["tokens"] += len(enc["ids"])
                seen["docs"] += len(enc["lengths"])
                writer.add(enc["ids"], enc["lengths"], enc.get("mask"))
        shards = writer.finish()
        num_docs = sum(s["num_docs"] for s in shards)
        if num_docs == 0:
            names = ", ".join(str(f) for f in files)
            what = (
                "no preference pair within --max-length"
                if preference
                else "no conversation with an assistant turn"
                if chat
                else "no text (only whitespace or nothing)"
            )
            raise DataError(f"empty corpus: {names} contain(s) {what}; pass files that hold the data to pack")
        copied = tok.copy_to(tmp)
        lengths = np.concatenate([np.diff(np.load(tmp / s["files"]["offsets"])) for s in shards])
        manifest = {
            **base_manifest(tok, dtype, "chat" if chat else data_format),
            "num_tokens": int(lengths.sum()),
            "num_docs": num_docs,
            "shards": shards,
            "sources": [str(f) for f in files],
            "part": part,
            "split": split if not chat else None,
            "min_doc_chars": min_doc_chars if split == "blank-lines" and not chat else None,
            "engine": engine,
            "chat_template": tmpl[0] if tmpl else None,
            "chat": ({**counts, "max_length": max_length, "overlong": overlong} if chat and not preference else None),
            **({MANIFEST_KEY: {**counts, "max_length": max_length}} if preference else {}),
            "doc_tokens": {"min": int(lengths.min()), "max": int(lengths.max()), "mean": float(lengths.mean())},
            "replaced_chars_total": sum(stats.replaced.values()),
            "replaced_chars": stats.replaced,
            "checksums": {p.name: sha256_file(p) for p in copied},
            "created_by": f"fitlm {__version__}",
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        return manifest

    return atomic_dir(out_dir, write, "fitlm data pack", needed)


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
    "pack_corpus",
    "sha256_file",
    "token_dtype",
]
