"""Tiny end-to-end runs through the real CLI: golden losses, generation, metrics, help texts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

GOLDEN = Path(__file__).parent / "golden" / "tiny_llama_20_steps.json"


@pytest.fixture(scope="module")
def tiny_run(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    cfg_path = write_config(root / "tiny.yaml", tiny_config(tiny_corpus, root / "out"))
    proc = fitlm("train", cfg_path, "--json")
    assert proc.returncode == 0, proc.stderr
    return {"out": root / "out", "summary": json.loads(proc.stdout), "config": cfg_path, "stderr": proc.stderr}


def test_golden_losses_of_the_first_20_steps(tiny_run):
    losses = [r["loss"] for r in read_metrics(tiny_run["out"]) if "loss" in r]
    assert len(losses) == 20
    if os.environ.get("FITLM_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert losses == pytest.approx(golden, rel=2e-4, abs=2e-4)
    assert losses[-1] < losses[0] - 1.0, "loss must fall visibly over 20 steps"


def test_metrics_records_carry_the_contract_fields(tiny_run):
    records = read_metrics(tiny_run["out"])
    steps = [r for r in records if "loss" in r]
    for r in steps:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_bytes"):
            assert key in r, key
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_bytes"] > 0
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert tiny_run["summary"]["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])


def test_output_dir_holds_config_and_model(tiny_run):
    out = tiny_run["out"]
    assert (out / "config.yaml").is_file()
    model = out / "model"
    assert {"config.yaml", "model.safetensors", "tokenizer.json"} <= {p.name for p in model.iterdir()}


def test_generate_json_is_deterministic_greedy(tiny_run):
    a = fitlm("generate", tiny_run["out"], "--prompt", "MACBETH.", "--max-new-tokens", "12", "--json")
    b = fitlm("generate", tiny_run["out"] / "model", "--prompt", "MACBETH.", "--max-new-tokens", "12", "--json")
    assert a.returncode == 0, a.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert set(ja) >= {"text", "token_ids"} and isinstance(ja["text"], str)
    assert 1 <= len(ja["token_ids"]) <= 12
    assert ja == jb


def test_rerun_into_the_same_output_dir_is_refused_and_keeps_the_run(tiny_run):
    before = (tiny_run["out"] / "metrics.jsonl").read_text()
    proc = fitlm("train", tiny_run["config"], "--set", "train.lr=0.5")
    assert proc.returncode == 2
    assert "holds a different run" in proc.stderr and "train.lr" in proc.stderr
    assert (tiny_run["out"] / "metrics.jsonl").read_text() == before


def test_dry_run_reports_the_shape_without_writing(tiny_corpus, tmp_path):
    cfg_path = write_config(tmp_path / "c.yaml", tiny_config(tiny_corpus, tmp_path / "out"))
    proc = fitlm("train", cfg_path, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["tokens_per_step"] == 4 * 2 * 64 and summary["params"] > 0
    assert not (tmp_path / "out").exists()


def test_help_texts_read_well():
    train = fitlm("train", "--help").stdout
    for phrase in ("CONFIG", "--set", "KEY=VALUE", "--nproc", "--dry-run", "train.output_dir"):
        assert phrase in train, phrase
    gen = fitlm("generate", "--help").stdout
    for phrase in ("--prompt", "--max-new-tokens", "--temperature", "--top-p", "--json", "greedy"):
        assert phrase in gen, phrase


def test_data_inspect_json(tiny_corpus):
    proc = fitlm("data", "inspect", tiny_corpus["train"], "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["num_tokens"] > 10_000 and report["num_docs"] > 10
    assert sum(row["count"] for row in report["length_histogram"]) == report["num_docs"]
    assert report["sample_token_ids"][0] == 0 and "MACBETH" in report["sample_text"].upper()


def test_init_from_a_trained_model_continues_from_its_weights(tiny_run, tiny_corpus, tmp_path):
    cfg = tiny_config(
        tiny_corpus, tmp_path / "cont", train={"max_steps": 2, "warmup_steps": 0, "lr": 1e-4, "min_lr": 1e-5}
    )
    cfg["model"] = {"init_from": str(tiny_run["out"] / "model")}  # every shape key comes from the weights
    proc = fitlm("train", write_config(tmp_path / "cont.yaml", cfg), "--json")
    assert proc.returncode == 0, proc.stderr
    first = read_metrics(tmp_path / "cont")[0]["loss"]
    trained = [r["loss"] for r in read_metrics(tiny_run["out"]) if "loss" in r]
    assert first < trained[0] - 0.8, (first, trained[0])  # starts where training got to, not from scratch
    cfg["model"]["hidden_size"] = 128
    bad = fitlm("train", write_config(tmp_path / "bad.yaml", cfg), "--overwrite")
    assert bad.returncode == 2 and "model.hidden_size: config 128 vs weights 64" in bad.stderr


def test_the_save_phase_starts_after_the_training_state_is_let_go(tiny_corpus, tmp_path):
    """host_memory.json's `save` figure is the final save's own peak: a full fine-tune's gradients and AdamW moments
    (12 of its 16 bytes per parameter) are released before the save phase starts, so its resident peak is far below
    the step's (marked before the release, the save's figure began at the training state still resident)."""
    model = {
        "hidden_size": 512,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
        "intermediate_size": 1376,
        "vocab_size": 8192,
        "max_seq_len": 64,
    }
    cfg = tiny_config(
        tiny_corpus,
        tmp_path / "run",
        model=model,
        train={"max_steps": 1, "eval_interval": 0, "gradient_accumulation_steps": 1},
    )
    proc = fitlm("train", write_config(tmp_path / "cfg.yaml", cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = json.loads((tmp_path / "run" / "host_memory.json").read_text())
    (step,), (save,) = peaks["step"], peaks["save"]
    params = 8 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1376) + 2 * 8192 * 512
    assert step - save > 0.5 * 12 * params, (step, save, 12 * params)
