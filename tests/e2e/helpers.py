"""Run the real `fitlm` CLI in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml


def fitlm(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fitlm.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def tiny_config(corpus: dict[str, Path], out_dir: Path, **sections) -> dict:
    """The golden tiny run: 2-layer GQA Llama, 20 steps, accumulation 2, every step logged."""
    cfg = {
        "model": {
            "arch": "llama",
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 176,
            "vocab_size": 512,
            "max_seq_len": 64,
            "tie_embeddings": False,
        },
        "data": {"train": str(corpus["train"]), "valid": str(corpus["valid"]), "seq_length": 64},
        "train": {
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "max_steps": 20,
            "lr": 1e-2,
            "min_lr": 1e-3,
            "warmup_steps": 5,
            "log_interval": 1,
            "eval_interval": 10,
            "eval_steps": 2,
            "seed": 7,
            "output_dir": str(out_dir),
            "progress": False,
        },
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


CHAT = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat" / "chatterbot_corpus.jsonl"


def pack_chat(root: Path, hf: Path, lines: int = 200) -> Path:
    """The first `lines` chat records of the example corpus packed (128 tokens) with the tokenizer in `hf`."""
    chat = root / "chat.jsonl"
    chat.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:lines]))
    r = fitlm(
        "data", "pack", chat, "--format", "chat", "--tokenizer", hf / "tokenizer.json",
        "--out", root / "chat", "--max-length", "128", "--overlong", "drop",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return root / "chat"


def qlora_run_config(hf: Path, packed: Path, out: Path, targets: list[str], steps: int) -> dict:
    """A QLoRA fine-tune of the checkpoint `hf` (a model section of `init_from` alone) on packed chat data, every
    step logged, at a learning rate that moves a tiny model within `steps` steps."""
    return {
        "model": {"init_from": str(hf)},
        "data": {"train": str(packed), "format": "chat", "seq_length": 128},
        "finetune": {"method": "qlora", "lora": {"r": 8, "alpha": 16.0, "target_modules": targets}},
        "memory": {"mixed_precision": "O2"},
        "train": {
            "micro_batch_size": 4,
            "max_steps": steps,
            "lr": 2e-2,
            "warmup_steps": 0,
            "log_interval": 1,
            "eval_interval": 0,
            "seed": 3,
            "progress": False,
            "peak_tflops": 1.0,
            "output_dir": str(out),
        },
    }


def hf_qwen3_moe(path: Path, seed: int, dtype=None, **overrides) -> Path:
    """A Qwen3-MoE checkpoint (6 experts, top 2, a dense block among the sparse ones; `overrides`: other
    transformers config keys) as transformers writes it, in `dtype` (None: fp32)."""
    return hf_moe(path, seed, "qwen3_moe", dtype, **overrides)


def hf_moe(path: Path, seed: int, model_type: str, dtype=None, **overrides) -> Path:
    """A checkpoint of the MoE family `model_type` (qwen3_moe, qwen2_moe: 6 experts, top 2, a dense block among
    the sparse ones; `overrides`: other transformers config keys, e.g. Qwen2-MoE's shared_expert_intermediate_size)
    as transformers writes it, in `dtype` (None: fp32)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    keys = dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        vocab_size=512,
        max_position_embeddings=64,
    )
    cfg = transformers.AutoConfig.for_model(model_type, **{**keys, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    (model.to(dtype) if dtype is not None else model).save_pretrained(path)
    return path
