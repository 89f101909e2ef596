"""SequenceLoader with document masks: labels at boundaries, positions, ranks, resume with prefetch,
max_length, shards, and reading packed directories of format v1."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from fitlm.data import IGNORE_INDEX, DataError, PackedDataset, SequenceLoader
from fitlm.data.prep import pack_corpus, train_tokenizer
from fitlm.data.rows import pack_rows, restart_positions

WORDS = "alpha beta gamma delta river stone cloud light shadow north south song bird tree 河流 石头 云".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(400)), encoding="utf-8")
    tok = train_tokenizer([src], 320, root / "tok")
    one = root / "one"
    pack_corpus([src], tok, one, show_progress=False)
    many = root / "many"
    pack_corpus([src], tok, many, show_progress=False, shard_tokens=700)  # several shards, same stream
    return {"root": root, "tok": tok, "one": one, "many": many, "src": src}


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _check_row_invariants(ds: PackedDataset, batch: dict, chat: bool = False) -> None:
    x, y, pos, doc = batch["input_ids"], batch["labels"], batch["position_ids"], batch["document_ids"]
    B, T = x.shape
    assert y.shape == pos.shape == doc.shape == (B, T)
    for r in range(B):
        for t in range(T):
            if t + 1 < T and doc[r, t] != doc[r, t + 1]:
                assert y[r, t] == IGNORE_INDEX  # never predict across a document boundary
                assert pos[r, t + 1] == 0  # positions restart at each document start
            elif t + 1 < T and not chat and x[r, t + 1] != ds.pad_id:
                assert y[r, t] == x[r, t + 1]  # inside a document: the next token
        assert pos[r, 0] == 0 and doc[r, 0] == 0
        assert (torch.diff(doc[r]) >= 0).all()  # distinct, increasing per document


def test_labels_positions_and_documents_at_boundaries(setup):
    ds = PackedDataset(setup["one"])
    loader = SequenceLoader(ds, seq_length=48, micro_batch_size=3, seed=0)
    boundaries = 0
    for batch in _take(loader, 6):
        _check_row_invariants(ds, batch)
        boundaries += int((torch.diff(batch["document_ids"], dim=1) != 0).sum())
        eos_inputs = batch["input_ids"] == ds.eos_id
        assert (batch["labels"][eos_inputs] == IGNORE_INDEX).all()  # the token after EOS starts another document
    assert boundaries > 10
    # Against the raw stream: row w is tokens [w*T, w*T+T+1) and the last label looks one token ahead.
    w = int(loader.windows_for(0, 0)[0])
    row = ds.read(w * 48, w * 48 + 49).astype(np.int64)
    first = next(SequenceLoader(ds, 48, 3, seed=0))
    doc = np.searchsorted(ds.doc_offsets, np.arange(w * 48, w * 48 + 49), side="right") - 1
    want = [int(b) if da == db else IGNORE_INDEX for b, da, db in zip(row[1:], doc[:-1], doc[1:])]
    assert first["input_ids"][0].tolist() == row[:-1].tolist() and first["labels"][0].tolist() == want


def test_restart_positions_and_pack_rows():
    assert restart_positions(np.array([[4, 4, 7, 7, 7, 9]])).tolist() == [[0, 1, 0, 1, 2, 0]]
    assert pack_rows(np.array([5, 5, 3, 9, 1]), 10).tolist() == [0, 2, 3, 5]  # 5+5 | 3 | 9+1


def test_sharded_directory_reads_like_one_shard(setup):
    one, many = PackedDataset(setup["one"]), PackedDataset(setup["many"])
    assert len(many.shards) > 3 and len(one.shards) == 1
    assert np.array_equal(one.read(0, one.num_tokens), many.read(0, many.num_tokens))
    assert np.array_equal(one.doc_offsets, many.doc_offsets)
    for a, b in zip(_take(SequenceLoader(one, 40, 2, seed=3), 20), _take(SequenceLoader(many, 40, 2, seed=3), 20)):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_ranks_disjoint_and_cover_the_epoch_in_docs_packing(setup):
    ds = PackedDataset(setup["one"])
    loaders = [SequenceLoader(ds, 64, 2, seed=9, rank=r, world_size=2, packing="docs") for r in range(2)]
    rows = [set(np.concatenate([lo.windows_for(0, k) for k in range(lo.batches_per_epoch)]).tolist()) for lo in loaders]
    assert not rows[0] & rows[1]
    assert len(rows[0] | rows[1]) == loaders[0].windows_per_epoch
    assert loaders[0].num_windows - loaders[0].windows_per_epoch < 4  # only the remainder is dropped
    # whole documents per row: every row starts at a document start, padding is never a target
    for batch in _take(loaders[0], 3):
        _check_row_invariants(ds, batch)
        pad = batch["input_ids"] == ds.pad_id
        assert (batch["labels"][pad] == IGNORE_INDEX).all()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_mid_epoch_equals_uninterrupted(setup, prefetch):
    ds = PackedDataset(setup["many"])
    make = lambda: SequenceLoader(ds, 32, 2, seed=4, prefetch=prefetch, num_workers=2)  # noqa: E731
    full = make()
    total = full.batches_per_epoch + 5  # across an epoch boundary
    reference = _take(full, total)
    for stop in (3, full.batches_per_epoch - 1, full.batches_per_epoch + 1):
        first = make()
        _take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # survives JSON (checkpoint metadata)
        assert state["position"] == stop % full.batches_per_epoch or stop == full.batches_per_epoch
        resumed = make()
        resumed.load_state_dict(state)
        for want, got in zip(reference[stop:], _take(resumed, total - stop)):
            assert all(torch.equal(want[k], got[k]) for k in want)
        # Reloading into a loader that already prefetched further must also land exactly.
        first.load_state_dict(state)
        assert torch.equal(next(first)["input_ids"], reference[stop]["input_ids"])
        first.close()


def test_max_length_truncates_single_documents(setup):
    ds = PackedDataset(setup["one"])
    lengths = np.diff(ds.doc_offsets)
    assert lengths.max() > 20
    loader = SequenceLoader(ds, 32, 4, seed=1, max_length=20)
    for batch in _take(loader, 10):
        assert batch["position_ids"].max() < 20
        _check_row_invariants(ds, batch)
    kept = int(np.minimum(lengths, 20).sum())
    assert loader.num_windows == (kept - 1) // 32
    with pytest.raises(DataError, match="max_length: checkpoint 20, now None"):
        SequenceLoader(ds, 32, 4, seed=1).load_state_dict(loader.state_dict())


def test_from_config_checks_the_format(setup):
    from fitlm.config import DataConfig

    ds = PackedDataset(setup["one"])
    lo = SequenceLoader.from_config(ds, DataConfig(seq_length=16, prefetch=0), 2, seed=0)
    assert lo.packing == "stream" and lo.prefetch == 0
    with pytest.raises(DataError, match="data.format is 'chat'.*--format text"):
        SequenceLoader.from_config(ds, DataConfig(seq_length=16, format="chat"), 2, seed=0)


def test_format_v1_directories_still_read(setup, tmp_path):
    """A directory packed by the first fitlm release (one tokens.bin) reads the same tokens and batches."""
    ds = PackedDataset(setup["one"])
    old = tmp_path / "v1"
    old.mkdir()
    shutil.copyfile(setup["one"] / "shard-00000.tokens.bin", old / "tokens.bin")
    shutil.copyfile(setup["one"] / "shard-00000.offsets.npy", old / "doc_offsets.npy")
    shutil.copyfile(setup["one"] / "tokenizer.json", old / "tokenizer.json")
    m = json.loads((setup["one"] / "manifest.json").read_text())
    v1 = {
        k: m[k]
        for k in (
            "format",
            "dtype",
            "num_tokens",
            "num_docs",
            "vocab_size",
            "tokenizer_sha256",
            "bos_id",
            "eos_id",
            "pad_id",
            "special_tokens",
        )
    }
    v1.update(format_version=1, checksums={"tokens.bin": m["shards"][0]["checksums"]["shard-00000.tokens.bin"]})
    (old / "manifest.json").write_text(json.dumps(v1))
    ds1 = PackedDataset(old)
    ds1.verify()
    assert ds1.data_format == "text" and np.array_equal(ds1.tokens, ds.tokens)
    a, b = next(SequenceLoader(ds1, 32, 2, seed=0)), next(SequenceLoader(ds, 32, 2, seed=0))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_corrupt_or_missing_shard_is_named(setup, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(setup["many"], copy)
    victim = "shard-00002"
    data = bytearray((copy / f"{victim}.tokens.bin").read_bytes())
    data[10] ^= 0xFF
    (copy / f"{victim}.tokens.bin").write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"shard {victim}: {victim}\.tokens\.bin has changed") as e:
        PackedDataset(copy).verify()
    assert "shard-00001" not in str(e.value)
    (copy / f"{victim}.tokens.bin").write_bytes(bytes(data[:-4]))
    with pytest.raises(DataError, match=rf"shard {victim}: .*truncated"):
        PackedDataset(copy)
    (copy / f"{victim}.tokens.bin").unlink()
    with pytest.raises(DataError, match=rf"shard {victim}: .*missing"):
        PackedDataset(copy)
