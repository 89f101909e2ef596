"""`fitlm data pack`'s options as one record (its CLI flags), checked all at once before anything is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitlm.data.errors import DataError
from fitlm.data.prep.ray_session import check_engine
from fitlm.data.prep.sources import DEFAULT_MIN_DOC_CHARS, Split, check_split

DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens: 512 MiB of uint16 per shard
OVERLONG = ("truncate", "drop")
FORMATS = ("text", "chat", "preference")


@dataclass(frozen=True)
class PackOptions:
    """How a pack reads, encodes and writes. data_format "chat": .jsonl conversations rendered with `template`
    (fitlm.data.chat), the loss on assistant tokens; a conversation over `max_length` tokens is truncated or
    dropped (`overlong`). "preference": .jsonl (prompt, chosen, rejected) rows, two documents per pair
    (fitlm.data.preference), a pair over `max_length` dropped. engine "ray": read and tokenize on Ray Data with
    `workers` tokenizer actors (fitlm.data.prep.pack_ray), the same shards as the local engine."""

    split: Split = "blank-lines"  # how text files become documents (fitlm.data.prep.sources)
    show_progress: bool = True
    overwrite: bool = False
    min_doc_chars: int = DEFAULT_MIN_DOC_CHARS
    data_format: str = "text"  # text, chat or preference
    template: str | None = None  # chat template: a name or a file (None: the tokenizer's own)
    workers: int = 1  # tokenizer processes (local) or actors (ray)
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    shard_index: int | None = None  # with num_shards: pack only every num_shards-th input from this one
    num_shards: int | None = None
    max_length: int | None = None  # chat / preference: tokens per conversation or sequence at most
    overlong: str = "truncate"  # chat: truncate or drop what exceeds max_length
    engine: str = "local"  # local or ray
    ray_address: str | None = None

    @property
    def preference(self) -> bool:
        return self.data_format == "preference"

    @property
    def chat(self) -> bool:
        """Stored as chat documents with a loss mask (preference pairs are too)."""
        return self.data_format in ("chat", "preference")

    @property
    def parted(self) -> bool:
        return self.shard_index is not None or self.num_shards is not None

    def check(self) -> None:
        """DataError naming the flag for the first option that cannot work."""
        check_split(self.split)
        check_engine(self.engine)
        if self.data_format not in FORMATS:
            raise DataError(f"--format {self.data_format!r} is not known; use text, chat or preference")
        if self.preference and self.engine != "local":
            raise DataError("--format preference packs with --engine local only; drop --engine ray")
        if self.preference and self.parted:
            # `fitlm data merge` would join the parts as chat data, without the marker that keeps pairs for DPO
            raise DataError("--format preference packs in one part; drop --shard-index / --num-shards (use --workers)")
        if self.overlong not in OVERLONG:
            raise DataError(f"--overlong {self.overlong!r} is not known; use truncate or drop")
        if self.workers < 1 or self.shard_tokens < 1 or (self.max_length is not None and self.max_length < 2):
            raise DataError("--workers and --shard-tokens must be at least 1 and --max-length at least 2")

    def part_of(self, files: list[Path]) -> tuple[list[Path], dict[str, Any] | None]:
        """The input files this part packs, and the manifest's `part` record (None: all of them, one part)."""
        if not self.parted:
            return files, None
        i, n = self.shard_index, self.num_shards
        if i is None or n is None or not 0 <= i < n:
            raise DataError(f"--shard-index {i} --num-shards {n}: give both, with 0 <= shard-index < num-shards")
        mine = files[i::n]
        if not mine:
            raise DataError(
                f"part {i} of {n} gets no input file ({len(files)} inputs); use fewer --num-shards than input files"
            )
        return mine, {"index": i, "count": n, "inputs_total": len(files)}


__all__ = ["DEFAULT_SHARD_TOKENS", "FORMATS", "OVERLONG", "PackOptions"]
