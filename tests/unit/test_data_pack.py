"""Packing at scale: parallel workers, shards with checksums, split packs and merge, tokenizer import, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fitlm.data import DataError, PackedDataset, Tokenizer
from fitlm.data.format import token_dtype
from fitlm.data.prep import pack_corpus, train_tokenizer
from fitlm.data.prep.merge import merge_packed
from fitlm.data.tokenizer_import import import_tokenizer

REPO = Path(__file__).resolve().parents[2]
PLAYS = REPO / "examples" / "data" / "shakespeare"
FIXTURES = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return train_tokenizer(sorted(PLAYS.glob("*.txt")), 500, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    """Six input files (plays cut in halves) so split packs get several files each."""
    root = tmp_path_factory.mktemp("inputs")
    out = []
    for play in sorted(PLAYS.glob("*.txt"))[:3]:
        text = play.read_text(encoding="utf-8")
        cut = text.index("\n\n", len(text) // 2)
        for i, part in enumerate((text[:cut], text[cut:])):
            out.append(root / f"{play.stem}_{i}.txt")
            out[-1].write_text(part, encoding="utf-8")
    return sorted(out)


def test_workers_and_shards_give_the_same_stream(tok, inputs, tmp_path):
    one = pack_corpus(inputs, tok, tmp_path / "w1", show_progress=False)
    two = pack_corpus(inputs, tok, tmp_path / "w2", show_progress=False, workers=2, shard_tokens=20_000)
    assert len(one["shards"]) == 1 and len(two["shards"]) > 3
    a, b = PackedDataset(tmp_path / "w1"), PackedDataset(tmp_path / "w2")
    assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    assert np.array_equal(a.doc_offsets, b.doc_offsets)
    for s in two["shards"]:  # documents never span shards; each shard has its own checksums
        assert s["num_tokens"] >= 20_000 or s is two["shards"][-1]
        assert set(s["checksums"]) == set(s["files"].values())
    b.verify()


def test_token_dtype_by_vocab_size():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32 and token_dtype(128_256) == np.uint32


def test_split_pack_and_merge_equal_one_pack(tok, inputs, tmp_path):
    pack_corpus(inputs, tok, tmp_path / "whole", show_progress=False)
    whole = PackedDataset(tmp_path / "whole")
    parts = []
    for i in (2, 0, 1):  # machines finish in any order
        m = pack_corpus(inputs, tok, tmp_path / f"part{i}", show_progress=False, shard_index=i, num_shards=3)
        assert m["part"] == {"index": i, "count": 3, "inputs_total": 6} and m["sources"] == [
            str(f) for f in inputs[i::3]
        ]
        parts.append(tmp_path / f"part{i}")
    with pytest.raises(DataError, match=r"parts of 3 expected; missing \[1\]"):
        merge_packed(parts[:2], tmp_path / "merged")
    merged = merge_packed(parts, tmp_path / "merged")
    assert merged["num_docs"] == whole.num_docs and merged["num_tokens"] == whole.num_tokens
    ds = PackedDataset(tmp_path / "merged")
    ds.verify()
    # Same documents (in part order rather than file order).
    key = lambda d: tuple(d.tolist())  # noqa: E731
    assert sorted(key(ds.document(i)) for i in range(ds.num_docs)) == sorted(
        key(whole.document(i)) for i in range(whole.num_docs)
    )
    other = train_tokenizer([inputs[0]], 300, tmp_path / "tok2")
    pack_corpus([inputs[0]], other, tmp_path / "foreign", show_progress=False)
    with pytest.raises(DataError, match="differ in tokenizer_sha256"):
        merge_packed([tmp_path / "whole", tmp_path / "foreign"], tmp_path / "m2")
    assert not (tmp_path / "m2").exists()


def test_import_tokenizer_json_and_sentencepiece(tok, tmp_path):
    out = import_tokenizer(tok, tmp_path / "copy")
    assert out.read_bytes() == Path(tok).read_bytes() and Tokenizer.from_file(out).pad_id == 2
    spm_tok = Tokenizer.from_file(import_tokenizer(FIXTURES / "spm_unigram.model", tmp_path / "spm"))
    assert (spm_tok.bos_id, spm_tok.eos_id, spm_tok.pad_id) == (1, 2, 3)
    expected = json.loads((FIXTURES / "spm_unigram_expected.json").read_text(encoding="utf-8"))
    for sample in expected["samples"]:  # ids produced by sentencepiece itself
        assert spm_tok.encode(sample["text"]) == sample["ids"], sample["text"]
        assert spm_tok.decode(sample["ids"]) == sample["decoded"]
    with pytest.raises(DataError, match="not a SentencePiece model"):
        (tmp_path / "junk.model").write_bytes(b"\xff\xff\xff")
        import_tokenizer(tmp_path / "junk.model", tmp_path / "junk")


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli_runner(capsys, monkeypatch):
    """Run `fitlm ...` in this process (a subprocess per call costs seconds of imports)."""
    from fitlm.cli import main

    def run(*args: str, cwd: Path) -> _Result:
        monkeypatch.chdir(cwd)
        rc = main(list(args))
        out = capsys.readouterr()
        return _Result(rc, out.out, out.err)

    return run


@pytest.mark.process
def test_cli_subprocess_smoke(tmp_path):
    """One real process: the console entry point parses `data` and prints exactly one JSON object."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fitlm.cli",
            "data",
            "tokenizer",
            str(PLAYS / "tempest_gut.txt"),
            "--vocab-size",
            "300",
            "--out",
            "t.json",
            "--json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["vocab_size"] == 300


def test_cli_pack_inspect_merge_with_json(tok, inputs, tmp_path, cli_runner):
    _cli = cli_runner
    r = _cli(
        "data",
        "pack",
        *map(str, inputs),
        "--tokenizer",
        str(tok),
        "--out",
        "p0",
        "--shard-index",
        "0",
        "--num-shards",
        "2",
        "--workers",
        "2",
        "--json",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["part"]["index"] == 0
    r = _cli(
        "data",
        "pack",
        *map(str, inputs),
        "--tokenizer",
        str(tok),
        "--out",
        "p1",
        "--shard-index",
        "1",
        "--num-shards",
        "2",
        "--json",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    r = _cli("data", "merge", "p0", "p1", "--out", "all", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_docs"] > 0 and len(json.loads(r.stdout)["shards"]) == 2
    r = _cli("data", "inspect", "all", "--json", "--verify", "--doc", "3", cwd=tmp_path)
    report = json.loads(r.stdout)
    assert report["verified"] and report["num_shards"] == 2 and report["sample_doc"] == 3
    assert report["sample_text"].startswith("<|bos|>") and len(report["sample_text"]) > 20
    r = _cli("data", "merge", "p0", "--out", "half", cwd=tmp_path)
    assert r.returncode == 2 and "missing [1]" in r.stderr and not (tmp_path / "half").exists()
