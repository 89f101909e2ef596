"""Reader: `PackedDataset` memory-maps a packed directory; `SequenceLoader` cuts it into training batches.

The loader is deterministic and resumable: batch k of epoch e depends only on (seed, e, k), and its
state is two integers, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fitlm.data.errors import DataError
from fitlm.data.pack import FORMAT, FORMAT_VERSION, MANIFEST_FILE, OFFSETS_FILE, TOKENS_FILE, sha256_file
from fitlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

IGNORE_INDEX = -100  # label value that cross-entropy skips (torch's default ignore_index)
_REQUIRED = ("dtype", "num_tokens", "num_docs", "vocab_size", "tokenizer_sha256", "bos_id", "eos_id", "pad_id")
_DTYPES = ("uint16", "uint32")
_MASK64 = (1 << 64) - 1


class PackedDataset:
    """A directory written by `pack_corpus`: token stream (memory-mapped), document offsets, manifest."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        m = self.manifest
        self.dtype = np.dtype(m["dtype"])
        tokens_path = self.path / TOKENS_FILE
        if not tokens_path.is_file():
            raise DataError(f"{tokens_path} is missing; the packed directory is incomplete; re-run `fitlm data pack`")
        expected = m["num_tokens"] * self.dtype.itemsize
        if tokens_path.stat().st_size != expected:
            raise DataError(f"{tokens_path} has {tokens_path.stat().st_size} bytes but the manifest says "
                            f"{m['num_tokens']} {m['dtype']} tokens ({expected} bytes); the file was truncated or "
                            "modified; re-run `fitlm data pack`")
        # Read-only map: pages come from the OS cache on demand and are shared between ranks on a node.
        self.tokens: np.ndarray = np.memmap(tokens_path, dtype=self.dtype, mode="r", shape=(m["num_tokens"],))
        offsets_path = self.path / OFFSETS_FILE
        try:
            self.doc_offsets: np.ndarray = np.load(offsets_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {offsets_path} ({e}); re-run `fitlm data pack`") from None
        if self.doc_offsets.shape != (m["num_docs"] + 1,) or int(self.doc_offsets[-1]) != m["num_tokens"]:
            raise DataError(f"{offsets_path} does not match the manifest ({m['num_docs']} documents, "
                            f"{m['num_tokens']} tokens); re-run `fitlm data pack`")

    # Memory maps do not pickle as maps; re-open by path in the receiving process (e.g. loader workers).
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def num_docs(self) -> int:
        return int(self.manifest["num_docs"])

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1 of the tokenizer the data was packed with."""
        return int(self.manifest["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.manifest["tokenizer_sha256"])

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_FILE

    @property
    def bos_id(self) -> int:
        return int(self.manifest["bos_id"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def pad_id(self) -> int:
        return int(self.manifest["pad_id"])

    def __len__(self) -> int:
        return self.num_tokens

    def document(self, index: int) -> np.ndarray:
        """Token ids of document `index`, BOS and EOS included."""
        if not 0 <= index < self.num_docs:
            raise IndexError(f"document {index} out of range (0..{self.num_docs - 1})")
        return np.asarray(self.tokens[int(self.doc_offsets[index]):int(self.doc_offsets[index + 1])])

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer stored beside the data, with the special-token names it was packed with."""
        names = self.manifest.get("special_tokens") or {}
        return Tokenizer.from_file(self.tokenizer_path, **{k: names.get(k) for k in ("bos", "eos", "pad")})

    def verify(self) -> None:
        """Recompute every checksum in the manifest (reads all the data); raise DataError on a mismatch."""
        bad = []
        for name, digest in self.manifest.get("checksums", {}).items():
            f = self.path / name
            if not f.is_file():
                bad.append(f"{name} is missing")
            elif sha256_file(f) != digest:
                bad.append(f"{name} has changed (sha256 differs from the manifest)")
        if bad:
            raise DataError(f"packed data {self.path} failed verification: {'; '.join(bad)}; re-run `fitlm data pack`")

    def __repr__(self) -> str:
        return f"PackedDataset({str(self.path)!r}, num_tokens={self.num_tokens}, num_docs={self.num_docs})"


def _read_manifest(path: Path) -> dict[str, Any]:
    hint = f"run `fitlm data pack ... --out {path}` first"
    if not path.is_dir():
        raise DataError(f"packed data directory {path} does not exist; {hint} (or fix data.train / data.valid)")
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        raise DataError(f"{path} is not packed data (it has no {MANIFEST_FILE}); {hint}")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{mpath} is not valid JSON ({e}); re-run `fitlm data pack`") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise DataError(f"{path} is not fitlm packed data ({MANIFEST_FILE} has format={got!r}, "
                        f"expected {FORMAT!r}); {hint}")
    version = m.get("format_version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise DataError(f"{path} uses packed-data format_version {version}, newer than this fitlm reads "
                            f"({FORMAT_VERSION}); upgrade fitlm or re-pack the data with this version")
        raise DataError(f"{path} has unknown packed-data format_version {version!r} (this fitlm reads "
                        f"{FORMAT_VERSION}); re-run `fitlm data pack`")
    missing = [k for k in _REQUIRED if k not in m]
    if missing:
        raise DataError(f"{mpath} lacks {', '.join(missing)}; re-run `fitlm data pack`")
    if m["dtype"] not in _DTYPES:
        raise DataError(f"{mpath} has dtype {m['dtype']!r}; expected one of {', '.join(_DTYPES)}; re-run `fitlm data pack`")
    return m


def check_compat(dataset: PackedDataset, model_vocab_size: int) -> None:
    """Refuse data whose token ids would index past the model's embedding table."""
    if dataset.vocab_size > model_vocab_size:
        raise DataError(
            f"data {dataset.path} was tokenized with a vocabulary of {dataset.vocab_size} ids but "
            f"model.vocab_size is {model_vocab_size}; raise model.vocab_size to at least {dataset.vocab_size} "
            "(or re-pack the data with a smaller tokenizer)"
        )


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def window_order(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled window order of one epoch, a pure function of (seed, epoch).

    Sorting by a fixed integer hash (splitmix64) rather than calling a library RNG keeps the order
    identical across numpy/torch versions and platforms, so a resumed run on new software still
    continues the same sequence.
    """
    key = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    key = _splitmix64(key ^ np.uint64(epoch & _MASK64))
    keys = _splitmix64(np.arange(num_windows, dtype=np.uint64) ^ key)
    return np.argsort(keys, kind="stable")


class SequenceLoader:
    """Endless iterator of training batches `{"input_ids", "labels"}` (LongTensor[B, T]) from a PackedDataset.

    The stream is cut into non-overlapping windows of seq_length + 1 tokens (window i starts at token
    i * seq_length). Each epoch orders the windows by `window_order(seed, epoch)`; rank r reads positions
    r, r + world_size, ... of that order, so ranks are disjoint and the global micro batch
    (micro_batch_size × world_size windows) is the same set whatever the split between ranks.
    Each rank yields `batches_per_epoch` batches per epoch; the few windows left over are dropped.
    """

    def __init__(self, dataset: PackedDataset, seq_length: int, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True):
        for name, v in (("data.seq_length", seq_length), ("train.micro_batch_size", micro_batch_size),
                        ("world_size", world_size)):
            if v < 1:
                raise DataError(f"{name} must be at least 1 (got {v})")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1} (world_size={world_size})")
        self.dataset = dataset
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.eos_id = dataset.eos_id
        self.num_windows = (dataset.num_tokens - 1) // seq_length  # windows that fit: start + T + 1 <= N
        per_step = micro_batch_size * world_size
        self.batches_per_epoch = self.num_windows // per_step
        if self.batches_per_epoch == 0:
            need = per_step * seq_length + 1
            raise DataError(
                f"data {dataset.path} is too small for seq_length={seq_length} with micro_batch_size="
                f"{micro_batch_size} on {world_size} rank(s): need at least {need} tokens, have "
                f"{dataset.num_tokens}; add data or lower data.seq_length / train.micro_batch_size"
            )
        self.windows_per_epoch = self.batches_per_epoch * per_step  # over all ranks
        self.tokens_per_epoch = self.windows_per_epoch * seq_length  # predicted tokens, all ranks
        self.epoch = 0
        self.position = 0  # batches this rank has yielded in the current epoch
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:  # one permutation cached: epochs are consumed in order
            if self.shuffle:
                self._order = window_order(self.num_windows, self.seed, epoch)
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def windows_for(self, epoch: int, position: int) -> np.ndarray:
        """Window indices of this rank's batch `position` in `epoch` (without advancing the loader)."""
        if not 0 <= position < self.batches_per_epoch:
            raise IndexError(f"batch {position} out of range (0..{self.batches_per_epoch - 1}) for one epoch")
        order = self._epoch_order(epoch)
        B, W = self.micro_batch_size, self.world_size
        slots = (position * B + np.arange(B)) * W + self.rank  # global slot of each sample
        return order[slots]

    def __iter__(self) -> SequenceLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        windows = self.windows_for(self.epoch, self.position)
        self.position += 1
        T = self.seq_length
        rows = np.stack([self.dataset.tokens[w * T: w * T + T + 1] for w in windows]).astype(np.int64)
        inputs = torch.from_numpy(rows[:, :-1].copy())
        labels = torch.from_numpy(rows[:, 1:].copy())
        # The token after an EOS starts an unrelated document: never train on predicting it.
        labels[inputs == self.eos_id] = IGNORE_INDEX
        return {"input_ids": inputs, "labels": labels}

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands; the same on every rank except `rank`, so saving rank 0's suffices."""
        return {
            "version": 1,
            "epoch": self.epoch,
            "position": self.position,
            "windows_consumed": self.position * self.micro_batch_size * self.world_size,
            "seed": self.seed,
            "seq_length": self.seq_length,
            "micro_batch_size": self.micro_batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "num_tokens": self.dataset.num_tokens,
            "tokenizer_sha256": self.dataset.tokenizer_sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off. A different rank count works when the global micro batch
        (micro_batch_size × world_size) divides the windows already consumed in the epoch."""
        same = {"seed": self.seed, "seq_length": self.seq_length, "shuffle": self.shuffle,
                "num_tokens": self.dataset.num_tokens, "tokenizer_sha256": self.dataset.tokenizer_sha256}
        diff = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in same.items() if state.get(k) != v]
        if diff:
            raise DataError("cannot resume the data loader, the run changed: " + "; ".join(diff)
                            + ". Resume with the same data, data.seq_length and train.seed, or start a fresh run")
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
