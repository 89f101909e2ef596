"""DPO from the command line, as a user runs it: `fitlm data pack --format preference`, then `fitlm train` with
LoRA (or QLoRA: its reference is the 4-bit base with adapters off) and `finetune.objective: dpo`; the rewards are logged beside the loss (metrics.jsonl and TensorBoard)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import fitlm, read_metrics, write_config
from tests.unit.test_dpo import MODEL, rows

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@pytest.mark.parametrize("method", ["lora", pytest.param("qlora", marks=pytest.mark.slow)])
def test_pack_and_train_dpo_with_lora(tiny_corpus, tmp_path, method):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    packed = tmp_path / "packed"
    proc = fitlm(
        "data",
        "pack",
        src,
        "--tokenizer",
        tiny_corpus["tokenizer"],
        "--out",
        packed,
        "--format",
        "preference",
        "--max-length",
        "65",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["preference"]["pairs"] == len(rows())
    out = tmp_path / "out"
    cfg = write_config(
        tmp_path / "dpo.yaml",
        {
            "model": MODEL,
            "data": {"train": str(packed), "valid": str(packed), "seq_length": 64, "format": "preference"},
            "finetune": {"method": method, "objective": "dpo", "lora": {"r": 4, "target_modules": ["all-linear"]}},
            "train": {
                "micro_batch_size": 2,
                "max_steps": 2,
                "lr": 1e-2,
                "warmup_steps": 0,
                "log_interval": 1,
                "eval_interval": 2,
                "eval_steps": 1,
                "output_dir": str(out),
                "progress": False,
                "observe": {"tensorboard": True},
            },
        },
    )
    proc = fitlm("train", cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    steps = [r for r in records if "loss" in r]
    # step 1: the policy is its reference (adapters start at zero), so every reward is 0 and the loss log 2
    assert steps[0]["loss"] == 0.693147 and all(steps[0][k] == 0.0 for k in REWARDS)
    assert steps[1]["rewards/margins"] != 0.0 and any("eval_loss" in r for r in records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert set(REWARDS) <= set(events.Tags()["scalars"])
    assert (out / "adapter" / "adapter_config.json").is_file()
