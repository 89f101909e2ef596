"""`SequenceLoader`: packed documents -> training batches, seeded, per-rank, resumable, with document masks.

Each batch is a dict of LongTensor[B, T]:

    input_ids     tokens
    labels        the next token, or -100 where there is no target: across a document boundary (the token
                  after a document's last token belongs to another document), on padding, and for chat data
                  on every token that is not an assistant token (the stored loss mask)
    position_ids  restart at 0 at each document start (and at the row start)
    document_ids  equal within one document of a row, different between documents (pad is its own id)

Rows are laid out one of three ways (`packing`):
  stream  (text data) the documents, back to back, are cut into non-overlapping windows of
          seq_length + 1 tokens (window i starts at token i * seq_length); nothing is padded.
  docs    (chat data) whole documents are placed greedily, in order, into rows of seq_length + 1 tokens
          and the rest is padded, so a conversation is never split from its prompt.
  pairs   (preference data, fitlm.data.preference) one document per row, padded; a sample is a pair
          (documents 2k, 2k + 1), and a batch of B pairs is 2B rows: the B chosen, then the B rejected.
Each epoch orders the rows by `window_order(seed, epoch)`; rank r reads positions r, r + world_size, ...
so ranks are disjoint and the global micro batch is the same set whatever the split between ranks.
Batch k of epoch e depends only on (seed, e, k), so the state is two integers and a resumed run sees
exactly the batches an uninterrupted one would, prefetching or not.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch

from fitlm.data.dataset import IGNORE_INDEX, PackedDataset
from fitlm.data.errors import DataError
from fitlm.data.preference import is_preference
from fitlm.data.rows import pack_rows, restart_positions, window_order

PACKINGS = ("stream", "docs", "pairs")


def _check_sizes(
    seq_length: int,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    max_length: int | None,
    num_workers: int,
    prefetch: int,
) -> None:
    """A `SequenceLoader`'s sizes are in range, or the DataError naming the first that is not."""
    for name, v in (
        ("data.seq_length", seq_length),
        ("train.micro_batch_size", micro_batch_size),
        ("world_size", world_size),
    ):
        if v < 1:
            raise DataError(f"{name} must be at least 1 (got {v})")
    if max_length is not None and max_length < 1:
        raise DataError(f"data.max_length must be at least 1 or null (got {max_length})")
    if num_workers < 0 or prefetch < 0:
        raise DataError(f"data.num_workers and data.prefetch must be >= 0 (got {num_workers}, {prefetch})")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside 0..{world_size - 1} (world_size={world_size})")


def _packing_of(dataset: PackedDataset, packing: str | None) -> str:
    """The packing asked for (None: the one of the dataset's format), checked against the dataset."""
    pairs = is_preference(dataset.manifest)
    packing = packing or ("pairs" if pairs else "docs" if dataset.data_format == "chat" else "stream")
    if packing not in PACKINGS:
        raise DataError(f"packing {packing!r} is not known; use one of {', '.join(PACKINGS)}")
    if (packing == "pairs") != pairs:
        raise DataError(f"packing {packing!r} does not fit {dataset.path}: pairs is for preference data only")
    return packing


class SequenceLoader:
    """Endless iterator of training batches from a PackedDataset (see the module docstring).

    max_length: hard cap on tokens kept per document (the rest of a longer document is dropped).
    num_workers / prefetch: threads assembling the next `prefetch` batches in the background (0 = inline).
    """

    def __init__(
        self,
        dataset: PackedDataset,
        seq_length: int,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        max_length: int | None = None,
        packing: str | None = None,
        num_workers: int = 0,
        prefetch: int = 0,
    ):
        _check_sizes(seq_length, micro_batch_size, rank, world_size, max_length, num_workers, prefetch)
        packing = _packing_of(dataset, packing)
        self.dataset = dataset
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.max_length = max_length
        self.packing = packing
        self.eos_id = dataset.eos_id
        self.num_workers, self.prefetch = num_workers, prefetch
        self._lay_out_rows()
        per_step = micro_batch_size * world_size
        self.batches_per_epoch = self.num_windows // per_step
        if self.batches_per_epoch == 0:
            raise self._too_small(per_step)
        self.windows_per_epoch = self.batches_per_epoch * per_step  # over all ranks
        self.tokens_per_epoch = self.windows_per_epoch * seq_length  # token slots, all ranks
        self.epoch = 0
        self.position = 0  # batches this rank has yielded in the current epoch
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[tuple[int, int], Future]] = deque()

    def _lay_out_rows(self) -> None:
        """The rows of `self.packing` over the dataset's documents, each kept to max_length tokens: the virtual
        stream offsets (stream), or each row's documents (docs, pairs), and how many windows there are."""
        lengths = np.diff(self.dataset.doc_offsets)
        max_length, seq_length = self.max_length, self.seq_length
        self._truncated = max_length is not None and bool((lengths > max_length).any())
        if self.packing == "stream":
            kept = np.minimum(lengths, cast(int, max_length)) if self._truncated else lengths  # (truncated: a max)
            self._vstart = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)  # virtual stream offsets
            self.num_windows = max(0, (int(self._vstart[-1]) - 1) // seq_length)  # start + T + 1 <= N
            return
        cap = seq_length + 1
        self._kept = np.minimum(lengths, cap if max_length is None else min(cap, max_length))
        if self.packing == "pairs":  # a row per document; a window is a pair of them
            if len(lengths) % 2:
                raise DataError(
                    f"{self.dataset.path} holds {len(lengths)} documents, not whole preference pairs; "
                    "re-pack it with `fitlm data pack --format preference`"
                )
            self._rows = np.arange(len(lengths) + 1, dtype=np.int64)
            self.num_windows = len(lengths) // 2
        else:
            self._rows = pack_rows(self._kept, cap)
            self.num_windows = max(0, len(self._rows) - 1)

    def _too_small(self, per_step: int) -> DataError:
        """The error of a dataset without one global micro batch of `per_step` windows."""
        need = (
            f"at least {per_step * self.seq_length + 1} tokens"
            if self.packing == "stream"
            else f"{per_step} {'pairs' if self.packing == 'pairs' else 'rows'}"
        )
        return DataError(
            f"data {self.dataset.path} is too small for seq_length={self.seq_length} with micro_batch_size="
            f"{self.micro_batch_size} on {self.world_size} rank(s): need {need}, have {self.dataset.num_tokens} "
            f"tokens ({self.num_windows} rows); add data or lower data.seq_length / train.micro_batch_size"
        )

    @classmethod
    def from_config(
        cls,
        dataset: PackedDataset,
        data_cfg,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> SequenceLoader:
        """The loader `data:` describes (seq_length, format, max_length, num_workers, prefetch)."""
        if (data_cfg.format == "preference") != is_preference(dataset.manifest):
            packed_as = "--format preference" if is_preference(dataset.manifest) else f"--format {dataset.data_format}"
            raise DataError(
                f"data.format is {data_cfg.format!r} but {dataset.path} was packed with {packed_as}; set "
                f"data.format: preference only for (and with) data packed with --format preference"
            )
        want = "chat" if data_cfg.format in ("chat", "preference") else "text"
        if dataset.data_format != want:
            packed_as = "--format chat" if dataset.data_format == "chat" else "--format text"
            raise DataError(
                f"data.format is {data_cfg.format!r} but {dataset.path} was packed with {packed_as}; "
                f"set data.format: {'chat' if dataset.data_format == 'chat' else 'pretrain'} or re-pack "
                "the data with the matching --format"
            )
        return cls(
            dataset,
            data_cfg.seq_length,
            micro_batch_size,
            seed,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            max_length=getattr(data_cfg, "max_length", None),
            num_workers=getattr(data_cfg, "num_workers", 0),
            prefetch=getattr(data_cfg, "prefetch", 0),
        )

    def _epoch_order(self, epoch: int) -> np.ndarray:
        with self._lock:  # one permutation cached (epochs are consumed in order); prefetch threads share it
            if self._order_epoch != epoch:
                self._order = (
                    window_order(self.num_windows, self.seed, epoch) if self.shuffle else np.arange(self.num_windows)
                )
                self._order_epoch = epoch
            assert self._order is not None  # (set above for the epoch)
            return self._order

    def windows_for(self, epoch: int, position: int) -> np.ndarray:
        """Row indices of this rank's batch `position` in `epoch` (without advancing the loader)."""
        if not 0 <= position < self.batches_per_epoch:
            raise IndexError(f"batch {position} out of range (0..{self.batches_per_epoch - 1}) for one epoch")
        order = self._epoch_order(epoch)
        B, W = self.micro_batch_size, self.world_size
        slots = (position * B + np.arange(B)) * W + self.rank  # global slot of each sample
        return order[slots]

    # ------------------------------------------------------------------ rows

    def _pieces(self, doc_ids: range, vstart: np.ndarray, a: int, b: int):
        """Yield (global doc, physical start, physical end) covering virtual [a, b) of documents doc_ids."""
        offs = self.dataset.doc_offsets
        for d in doc_ids:
            lo, hi = int(vstart[d]), int(vstart[d + 1])
            s, e = max(a, lo), min(b, hi)
            if s < e:
                yield d, int(offs[d]) + s - lo, int(offs[d]) + e - lo

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row `index` as (tokens, loss mask, document index) arrays of seq_length + 1; pad has doc -1."""
        ds, n = self.dataset, self.seq_length + 1
        chat = ds.data_format == "chat"
        if self.packing == "stream":
            a, b = index * self.seq_length, index * self.seq_length + n
            if not self._truncated:  # virtual stream == physical stream: one read per shard touched
                tokens = ds.read(a, b)
                mask = ds.read(a, b, mask=True) if chat else np.ones(n, np.uint8)
                doc = np.searchsorted(ds.doc_offsets, np.arange(a, b), side="right") - 1
                return tokens, mask, doc
            d0 = int(np.searchsorted(self._vstart, a, side="right")) - 1
            d1 = int(np.searchsorted(self._vstart, b, side="left"))
            pieces = list(self._pieces(range(d0, d1), self._vstart, a, b))
        else:
            d0, d1 = int(self._rows[index]), int(self._rows[index + 1])
            pieces = [(d, int(ds.doc_offsets[d]), int(ds.doc_offsets[d]) + int(self._kept[d])) for d in range(d0, d1)]
        tokens = np.full(n, ds.pad_id, dtype=np.int64)
        mask = np.zeros(n, np.uint8)
        doc = np.full(n, -1, dtype=np.int64)
        at = 0
        for d, s, e in pieces:
            tokens[at : at + e - s] = ds.read(s, e)
            mask[at : at + e - s] = ds.read(s, e, mask=True) if chat else 1
            doc[at : at + e - s] = d
            at += e - s
        return tokens, mask, doc

    def _batch(self, epoch: int, position: int) -> dict[str, torch.Tensor]:
        windows = self.windows_for(epoch, position)
        if self.packing == "pairs":  # B pairs -> 2B rows: chosen documents (2k), then rejected ones (2k + 1)
            windows = np.concatenate([2 * windows, 2 * windows + 1])
        rows = [self.row(int(w)) for w in windows]
        tokens = np.stack([r[0] for r in rows]).astype(np.int64)  # [B, T+1]
        mask = np.stack([r[1] for r in rows]).astype(bool)
        doc = np.stack([r[2] for r in rows])
        # Pad (doc -1) gets an id of its own, above every real document of the row.
        doc = np.where(doc < 0, doc.max(axis=1, keepdims=True) + 1, doc)
        doc_in, doc_next = doc[:, :-1], doc[:, 1:]
        real_next = np.stack([r[2] for r in rows])[:, 1:] >= 0
        keep = (doc_in == doc_next) & mask[:, 1:] & real_next  # a target inside the same document, trained on
        labels = np.where(keep, tokens[:, 1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
            "labels": torch.from_numpy(np.ascontiguousarray(labels)),
            "position_ids": torch.from_numpy(restart_positions(doc_in)),
            "document_ids": torch.from_numpy(np.ascontiguousarray(doc_in - doc_in[:, :1])),
        }

    # ------------------------------------------------------------------ iteration and state

    def _next_key(self, key: tuple[int, int]) -> tuple[int, int]:
        epoch, position = key
        return (epoch + 1, 0) if position + 1 >= self.batches_per_epoch else (epoch, position + 1)

    def __iter__(self) -> SequenceLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        key = (self.epoch, self.position)
        if self.prefetch > 0:
            batch = self._prefetched(key)
        else:
            batch = self._batch(*key)
        self.position += 1
        return batch

    def _prefetched(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.num_workers), thread_name_prefix="fitlm-loader")
        if not self._pending or self._pending[0][0] != key:  # first call, or the state was reloaded
            for _, f in self._pending:
                f.cancel()
            self._pending.clear()
        nxt = self._pending[-1][0] if self._pending else None
        while len(self._pending) < self.prefetch + 1:
            nxt = key if nxt is None else self._next_key(nxt)
            self._pending.append((nxt, self._pool.submit(self._batch, *nxt)))
        return self._pending.popleft()[1].result()

    def close(self) -> None:
        """Stop the prefetch threads (they also stop at interpreter exit)."""
        for _, f in self._pending:
            f.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands (batches handed out, not prefetched); the same on every rank except
        `rank`, so saving rank 0's suffices."""
        return {
            "version": 2,
            "epoch": self.epoch,
            "position": self.position,
            "windows_consumed": self.position * self.micro_batch_size * self.world_size,
            "seed": self.seed,
            "seq_length": self.seq_length,
            "micro_batch_size": self.micro_batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "max_length": self.max_length,
            "packing": self.packing,
            "num_tokens": self.dataset.num_tokens,
            "tokenizer_sha256": self.dataset.tokenizer_sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off. A different rank count works when the global micro batch
        (micro_batch_size × world_size) divides the windows already consumed in the epoch."""
        same = {
            "seed": self.seed,
            "seq_length": self.seq_length,
            "shuffle": self.shuffle,
            "max_length": self.max_length,
            "num_tokens": self.dataset.num_tokens,
            "tokenizer_sha256": self.dataset.tokenizer_sha256,
        }
        if "packing" in state:  # version-1 states predate it (they were all "stream")
            same["packing"] = self.packing
        elif self.packing != "stream":
            same["packing"] = self.packing
            state = {**state, "packing": "stream"}
        diff = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in same.items() if state.get(k) != v]
        if diff:
            raise DataError(
                "cannot resume the data loader, the run changed: "
                + "; ".join(diff)
                + ". Resume with the same data, data.seq_length, data.max_length and train.seed, "
                "or start a fresh run"
            )
        per_step = self.micro_batch_size * self.world_size
        consumed = int(state["windows_consumed"])
        if consumed % per_step:
            raise DataError(
                f"cannot resume the data loader: {consumed} windows of epoch {state['epoch']} were consumed, "
                f"which is not a whole number of global micro batches of {per_step} (micro_batch_size × "
                "world_size); resume with a layout whose micro_batch_size × data_parallel divides it"
            )
        self.epoch = int(state["epoch"])
        self.position = consumed // per_step
        if self.position > self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0  # only the dropped remainder was left in the epoch
        # Anything prefetched for the old position is discarded on the next call (its key no longer matches).


__all__ = ["PACKINGS", "SequenceLoader", "pack_rows", "restart_positions", "window_order"]
