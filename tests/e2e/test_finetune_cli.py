"""The fine-tuning path through the real CLI: import an HF model, LoRA on packed chat data (one process
and data parallel), merge, generate; and the bad inputs a user can make, each with its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fitlm.config import ModelConfig, validate_dict
from fitlm.finetune.errors import FinetuneError
from fitlm.finetune.importer import import_model
from fitlm.finetune.merge import merge_model
from fitlm.models.hf import save_hf_dir
from fitlm.registry import build_model
from fitlm.train.preflight import unsupported_options
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import fitlm, read_metrics, write_config

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "examples" / "data" / "chat" / "chatterbot_corpus.jsonl"


@pytest.fixture(scope="module")
def base(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    """An HF directory (random tiny Llama + the test tokenizer), imported; chat data packed with its tokenizer."""
    root = tmp_path_factory.mktemp("ft")
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_seq_len=128,
    )
    save_hf_dir(build_model(cfg), cfg, root / "hf")
    (root / "hf" / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    r = fitlm("import", root / "hf", "--out", root / "base", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokenizer"] is True
    chat = root / "chat.jsonl"  # a quarter of the shipped set: enough for 4 steps, faster to pack
    chat.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:250]))
    r = fitlm(
        "data",
        "pack",
        chat,
        "--format",
        "chat",
        "--tokenizer",
        root / "base" / "tokenizer.json",
        "--out",
        root / "chat",
        "--max-length",
        "128",
        "--overlong",
        "drop",
    )
    assert r.returncode == 0, r.stderr
    return {"root": root, "hf": root / "hf", "base": root / "base", "chat": root / "chat"}


def lora_config(base: dict[str, Path], out: Path, **train) -> dict:
    return {
        "model": {"init_from": str(base["base"])},
        "data": {"train": str(base["chat"]), "valid": str(base["chat"]), "format": "chat", "seq_length": 128},
        "finetune": {"method": "lora", "lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}},
        "train": {
            "micro_batch_size": 4,
            "max_steps": 4,
            "lr": 1e-2,
            "warmup_steps": 0,
            "log_interval": 1,
            "eval_interval": 2,
            "eval_steps": 1,
            "seed": 3,
            "progress": False,
            "peak_tflops": 1.0,
            "output_dir": str(out),
            **train,
        },
    }


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def single(base) -> Path:
    out = base["root"] / "lora1"
    r = fitlm("train", write_config(base["root"] / "lora1.yaml", lora_config(base, out)))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_lora_train_merge_generate(base, single):
    assert (single / "adapter" / "adapter_config.json").is_file()
    merged = base["root"] / "merged"
    r = fitlm("merge", base["base"], "--adapter", single / "adapter", "--out", merged, "--json")
    assert r.returncode == 0, r.stderr
    # fitlm merge of base + adapter gives the weights the run saved in model/ (both fp32 W + scale·BA).
    ours, run = load_file(str(merged / "model.safetensors")), load_file(str(single / "model" / "model.safetensors"))
    assert ours.keys() == run.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], run[k], rtol=1e-6, atol=1e-6)
    base_w = load_file(str(base["base"] / "model.safetensors"))
    assert not torch.equal(
        ours["model.layers.0.self_attn.q_proj.weight"], base_w["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(ours["model.layers.0.self_attn.k_proj.weight"], base_w["model.layers.0.self_attn.k_proj.weight"])
    r = fitlm("generate", merged, "--prompt", "Hello", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    # Merging onto the run's own (already merged) model would add the adapter twice: refused.
    with pytest.raises(FinetuneError, match="already include"):
        merge_model(single, single / "adapter", base["root"] / "twice")
    assert not (base["root"] / "twice").exists()


def test_lora_under_two_rank_data_parallel_equals_one_process(base, single):
    out = base["root"] / "lora-dp2"
    cfg = lora_config(base, out, micro_batch_size=2)
    cfg["parallel"] = {"data_parallel": 2, "zero_stage": 3}  # ZeRO-3 also shards the frozen base
    r = fitlm("train", write_config(base["root"] / "dp2.yaml", cfg), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == pytest.approx(losses(single), rel=1e-5, abs=1e-6)
    a, b = (
        load_file(str(out / "adapter" / "adapter_model.safetensors")),
        load_file(str(single / "adapter" / "adapter_model.safetensors")),
    )
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_bad_finetune_inputs(base, tmp_path):
    cfg = lora_config(base, tmp_path / "out")
    cfg["finetune"]["lora"]["target_modules"] = ["qkv"]
    with pytest.raises(FinetuneError, match="qkv match no linear layer"):
        Trainer(validate_dict(cfg))
    assert not (tmp_path / "out").exists()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((base["hf"] / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    r = fitlm("import", pickled, "--out", tmp_path / "imported")
    assert r.returncode == 2 and "pickle" in r.stderr and not (tmp_path / "imported").exists()
    # --weights-only reads the tensors (no code) and then finds they are not a model.
    with pytest.raises(ValueError, match="model.embed_tokens.weight|missing"):
        import_model(pickled, tmp_path / "imported", weights_only=True)
    with pytest.raises(FinetuneError, match="adapter_config.json"):
        merge_model(base["base"], tmp_path, tmp_path / "m")
    cfg = lora_config(base, tmp_path / "out2")
    cfg["parallel"] = {"tensor_parallel": 2}
    assert unsupported_options(validate_dict(cfg)) == []  # LoRA composes with tensor parallel now
