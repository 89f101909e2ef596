"""Reader: `PackedDataset` memory-maps a packed directory (any number of shards) as one token stream.

Batches are cut by `fitlm.data.loader.SequenceLoader`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fitlm.data.errors import DataError
from fitlm.data.format import read_manifest, sha256_file
from fitlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

if TYPE_CHECKING:
    from fitlm.data.prompts import PromptDataset

IGNORE_INDEX = -100  # label value that cross-entropy skips (torch's default ignore_index)


@dataclass
class Shard:
    """One shard's maps. `mask` (uint8, 1 = train on this token) exists for chat data only."""

    name: str
    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None


def _open_shard(path: Path, entry: dict[str, Any], dtype: np.dtype, chat: bool) -> Shard:
    files = entry["files"]
    name = entry.get("name", files["tokens"])
    redo = "re-run `fitlm data pack` for it (or restore the file)"
    tpath = path / files["tokens"]
    if not tpath.is_file():
        raise DataError(f"shard {name}: {tpath} is missing; the packed directory is incomplete; {redo}")
    n = int(entry["num_tokens"])
    if tpath.stat().st_size != n * dtype.itemsize:
        raise DataError(
            f"shard {name}: {tpath} has {tpath.stat().st_size} bytes but the manifest says {n} "
            f"{dtype.name} tokens ({n * dtype.itemsize} bytes); the file was truncated or modified; {redo}"
        )
    # Read-only maps: pages come from the OS cache on demand and are shared between ranks on a node.
    tokens = np.memmap(tpath, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    opath = path / files["offsets"]
    try:
        offsets = np.load(opath, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"shard {name}: cannot read {opath} ({e}); {redo}") from None
    if offsets.shape != (int(entry["num_docs"]) + 1,) or int(offsets[-1]) != n or int(offsets[0]) != 0:
        raise DataError(
            f"shard {name}: {opath} does not match the manifest ({entry['num_docs']} documents, {n} tokens); {redo}"
        )
    mask = None
    if chat:
        if "mask" not in files:
            raise DataError(f"shard {name}: chat data without a loss-mask file; {redo}")
        mpath = path / files["mask"]
        if not mpath.is_file() or mpath.stat().st_size != n:
            raise DataError(f"shard {name}: loss mask {mpath} is missing or not {n} bytes; {redo}")
        mask = np.memmap(mpath, dtype=np.uint8, mode="r", shape=(n,)) if n else np.zeros(0, np.uint8)
    return Shard(name, tokens, offsets, mask)


class PackedDataset:
    """A directory written by `fitlm data pack` (format v2, or v1 from older fitlm): shards, manifest.

    Documents are numbered globally across shards in manifest order; `doc_offsets` gives their starts
    in the concatenated stream (shard 0's tokens, then shard 1's, ...).
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.dtype = np.dtype(m["dtype"])
        self.data_format: str = m["data_format"]
        self.shards = [_open_shard(self.path, e, self.dtype, self.data_format == "chat") for e in m["shards"]]
        if (
            sum(len(s.tokens) for s in self.shards) != m["num_tokens"]
            or sum(len(s.offsets) - 1 for s in self.shards) != m["num_docs"]
        ):
            raise DataError(
                f"{self.path}: the shards' sizes do not add up to the manifest's num_tokens/num_docs; "
                "re-run `fitlm data pack`"
            )
        starts = np.cumsum([0] + [len(s.tokens) for s in self.shards])
        self.shard_token_starts = starts  # [num_shards + 1]
        # Global document offsets: small (8 bytes per document) and needed by every loader lookup.
        parts = [np.asarray(s.offsets[:-1], dtype=np.int64) + starts[i] for i, s in enumerate(self.shards)]
        self.doc_offsets: np.ndarray = np.concatenate(parts + [np.array([starts[-1]], dtype=np.int64)])

    # Memory maps do not pickle as maps; re-open by path in the receiving process (e.g. loader workers).
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["path"])

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
    def bos_id(self) -> int | None:
        """None for a model without BOS (e.g. Qwen)."""
        bos = self.manifest["bos_id"]
        return None if bos is None else int(bos)

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def pad_id(self) -> int:
        return int(self.manifest["pad_id"])

    @property
    def tokens(self) -> np.ndarray:
        """The token stream of a one-shard directory (the memmap itself); use `read` for any layout."""
        if len(self.shards) != 1:
            raise DataError(
                f"{self.path} has {len(self.shards)} shards; read tokens with PackedDataset.read(start, end)"
            )
        return self.shards[0].tokens

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, end: int, mask: bool = False) -> np.ndarray:
        """Tokens [start, end) of the concatenated stream (or the loss mask, for chat data), as a copy."""
        out = []
        first = int(np.searchsorted(self.shard_token_starts, start, side="right")) - 1
        for i in range(max(first, 0), len(self.shards)):
            lo, hi = self.shard_token_starts[i], self.shard_token_starts[i + 1]
            if lo >= end:
                break
            shard = self.shards[i]
            arr = shard.mask if mask else shard.tokens
            if arr is None:
                arr = np.ones(len(shard.tokens), np.uint8)  # text data: every token is a target
            out.append(np.asarray(arr[max(start, lo) - lo : min(end, hi) - lo]))
        return np.concatenate(out) if out else np.zeros(0, np.uint8 if mask else self.dtype)

    def document(self, index: int) -> np.ndarray:
        """Token ids of document `index`, BOS (when the model has one) and EOS included."""
        if not 0 <= index < self.num_docs:
            raise IndexError(f"document {index} out of range (0..{self.num_docs - 1})")
        return self.read(int(self.doc_offsets[index]), int(self.doc_offsets[index + 1]))

    def document_mask(self, index: int) -> np.ndarray:
        """Loss mask of document `index` (uint8; all ones for text data)."""
        return self.read(int(self.doc_offsets[index]), int(self.doc_offsets[index + 1]), mask=True)

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer stored beside the data, with the special-token names it was packed with."""
        names = self.manifest.get("special_tokens") or {}
        return Tokenizer.from_file(self.tokenizer_path, **{k: names.get(k) for k in ("bos", "eos", "pad")})

    def verify(self) -> None:
        """Recompute every checksum in the manifest (reads all the data); raise DataError naming each bad shard."""
        bad = []
        entries = [(e.get("name", "?"), e.get("checksums", {})) for e in self.manifest["shards"]]
        entries.append(("tokenizer", self.manifest.get("checksums", {})))
        for owner, sums in entries:
            for name, digest in sums.items():
                f = self.path / name
                what = name if owner in (name, "tokenizer") else f"shard {owner}: {name}"
                if not f.is_file():
                    bad.append(f"{what} is missing")
                elif sha256_file(f) != digest:
                    bad.append(f"{what} has changed (sha256 differs from the manifest)")
        if bad:
            raise DataError(
                f"packed data {self.path} failed verification: {'; '.join(bad)}; re-run `fitlm data pack` "
                "for the named shard(s) (or restore them from a copy)"
            )

    def __repr__(self) -> str:
        return (
            f"PackedDataset({str(self.path)!r}, format={self.data_format}, shards={len(self.shards)}, "
            f"num_tokens={self.num_tokens}, num_docs={self.num_docs})"
        )


def check_compat(dataset: PackedDataset | PromptDataset, model_vocab_size: int) -> None:
    """Refuse data whose token ids would index past the model's embedding table."""
    if dataset.vocab_size > model_vocab_size:
        raise DataError(
            f"data {dataset.path} was tokenized with a vocabulary of {dataset.vocab_size} ids but "
            f"model.vocab_size is {model_vocab_size}; raise model.vocab_size to at least {dataset.vocab_size} "
            "(or re-pack the data with a smaller tokenizer)"
        )
