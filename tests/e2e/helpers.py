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
