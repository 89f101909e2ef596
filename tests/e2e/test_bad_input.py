"""Every bad input a user can make: exit status 2, a message naming the key or file and the fix, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from fitlm.cli import main
from tests.e2e.helpers import tiny_config, write_config


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.fixture
def cfg(tiny_corpus, tmp_path):
    return tiny_config(tiny_corpus, tmp_path / "out")


def train_fails(capsys, tmp_path, cfg, *expected: str, extra=()) -> str:
    path = write_config(tmp_path / "bad.yaml", cfg)
    code, err = run_cli(capsys, "train", path, *extra)
    assert code == 2, err
    for text in expected:
        assert text in err, (text, err)
    assert not (tmp_path / "out").exists(), "a failed start must not create the output directory"
    return err


def test_malformed_yaml(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: 64\n   num_layers: 2\n")
    code, err = run_cli(capsys, "train", path)
    assert code == 2 and "malformed YAML at line 3" in err and str(path) in err


def test_unknown_key_suggests_the_valid_one(capsys, tmp_path, cfg):
    cfg["train"]["learning_rate"] = 1e-3  # the HF Trainer's name for it
    train_fails(capsys, tmp_path, cfg, "train.learning_rate: unknown key", "did you mean train.lr?")
    cfg["train"].pop("learning_rate")
    cfg["train"]["xyzzy"] = 1
    train_fails(capsys, tmp_path, cfg, "train.xyzzy: unknown key", "valid keys here", "lr")


def test_misspelt_key(capsys, tmp_path, cfg):
    cfg["model"]["num_kv_head"] = 2
    train_fails(capsys, tmp_path, cfg, "did you mean model.num_kv_heads?")


def test_wrong_type(capsys, tmp_path, cfg):
    cfg["train"]["max_steps"] = "twenty"
    train_fails(capsys, tmp_path, cfg, "train.max_steps", "valid integer", "--set train.max_steps=")


def test_heads_not_divisible_by_kv_heads(capsys, tmp_path, cfg):
    cfg["model"]["num_kv_heads"] = 3
    train_fails(capsys, tmp_path, cfg, "model.num_kv_heads", "must divide num_heads", "valid: [1, 2, 4]")


def test_hidden_not_divisible_by_heads(capsys, tmp_path, cfg):
    cfg["model"]["hidden_size"] = 66
    train_fails(capsys, tmp_path, cfg, "model.hidden_size: 66 is not divisible by model.num_heads=4")


def test_seq_length_above_max_seq_len(capsys, tmp_path, cfg):
    cfg["data"]["seq_length"] = 128
    train_fails(capsys, tmp_path, cfg, "data.seq_length: 128 exceeds model.max_seq_len=64")


def test_override_errors_are_reported_with_the_file_ones(capsys, tmp_path, cfg):
    cfg["model"]["num_kv_heads"] = 3
    train_fails(
        capsys,
        tmp_path,
        cfg,
        "2 problem(s)",
        "model.num_kv_heads",
        "data.seq_length",
        extra=["--set", "data.seq_length=1000"],
    )


def test_data_vocab_larger_than_model_vocab(capsys, tmp_path, cfg):
    cfg["model"]["vocab_size"] = 300
    train_fails(capsys, tmp_path, cfg, "300", "512", "model.vocab_size")


def test_tokenizer_without_pad_token(capsys, tmp_path, cfg, tiny_corpus):
    broken = tmp_path / "train"
    shutil.copytree(tiny_corpus["train"], broken)
    tok = json.loads((broken / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|pad|>"]
    tok["model"]["vocab"].pop("<|pad|>", None)
    (broken / "tokenizer.json").write_text(json.dumps(tok))
    cfg["data"]["train"] = str(broken)
    train_fails(capsys, tmp_path, cfg, "<|pad|>", "tokenizer.json")


def test_missing_data_dir(capsys, tmp_path, cfg):
    cfg["data"]["train"] = str(tmp_path / "nowhere")
    train_fails(capsys, tmp_path, cfg, "nowhere", "fitlm data pack")


def test_output_dir_with_foreign_files_is_left_alone(capsys, tmp_path, cfg):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    path = write_config(tmp_path / "c.yaml", cfg)
    for extra in ((), ("--overwrite",)):
        code, err = run_cli(capsys, "train", path, *extra)
        assert code == 2 and "holds no fitlm run" in err
        assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_nproc_that_contradicts_the_layout(capsys, tmp_path, cfg):
    err = train_fails(capsys, tmp_path, cfg, "= 1, but 2 processes run", extra=["--nproc", "2"])
    assert "valid layouts for 2: dp2×tp1×pp1, dp1×tp1×pp2, dp1×tp2×pp1" in err


def test_empty_corpus_is_refused_by_tokenizer_and_pack(capsys, tmp_path, tiny_corpus):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    code, err = run_cli(capsys, "data", "tokenizer", empty, "--vocab-size", "300", "--out", tmp_path / "t.json")
    assert code == 2 and "empty.txt" in err and not (tmp_path / "t.json").exists()
    code, err = run_cli(capsys, "data", "pack", empty, "--tokenizer", tiny_corpus["tokenizer"], "--out", tmp_path / "p")
    assert code == 2 and "empty.txt" in err and not (tmp_path / "p").exists()
