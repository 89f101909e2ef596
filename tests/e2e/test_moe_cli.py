"""A mixture of experts trained from a YAML model section, as a user runs it: Qwen3-MoE with a dense block
among sparse ones; the load-balancing loss is in the gradient (changing its weight changes the run) and in
metrics.jsonl beside the expert load; full recompute reproduces the run exactly (the router logits that the
aux loss reads survive the recomputation); the trained model generates and exports to transformers."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from fitlm.models.io import load_model_dir
from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

MOE = {
    "arch": "qwen3_moe",
    "intermediate_size": 96,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "mlp_only_layers": [1],
}


def train(tiny_corpus, out, **sections) -> list[dict]:
    sections = {**sections, "model": {**MOE, **sections.get("model", {})}}
    sections.setdefault("train", {}).update(max_steps=6, eval_interval=0, warmup_steps=1)
    cfg = write_config(out.parent / f"{out.name}.yaml", tiny_config(tiny_corpus, out, **sections))
    proc = fitlm("train", cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r for r in read_metrics(out) if "loss" in r and "step" in r and "eval_loss" not in r]


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {
        "base": train(tiny_corpus, root / "base", model={"router_aux_loss_coef": 0.5}),
        "recompute": train(
            tiny_corpus, root / "recompute", model={"router_aux_loss_coef": 0.5}, memory={"recompute": "full"}
        ),
        "no_aux": train(tiny_corpus, root / "no_aux", model={"router_aux_loss_coef": 0.0}),
        "root": root,
    }


def test_metrics_log_the_aux_loss_and_the_expert_load(runs):
    for r in runs["base"]:
        assert math.isfinite(r["loss"]) and r["aux_loss"] >= 1.0 - 1e-6  # E·sum f·P >= 1, equal when balanced
        assert 1.0 <= r["expert_load"] <= 4 / 2  # max/mean tokens per expert: at most E/k
    assert runs["base"][-1]["loss"] < runs["base"][0]["loss"]


def test_the_aux_loss_is_in_the_gradient(runs):
    base, no_aux = runs["base"], runs["no_aux"]
    assert base[0]["loss"] == no_aux[0]["loss"]  # same weights, same batch: the first forward agrees
    assert [r["loss"] for r in base[1:]] != [r["loss"] for r in no_aux[1:]]
    assert "aux_loss" in no_aux[0]  # still logged with the term off


def test_full_recompute_reproduces_the_run(runs):
    assert [(r["loss"], r["aux_loss"]) for r in runs["recompute"]] == [(r["loss"], r["aux_loss"]) for r in runs["base"]]


def test_the_trained_moe_generates_and_exports_to_transformers(runs, tmp_path):
    out = runs["root"] / "base"
    proc = fitlm("generate", out, "--prompt", "MACBETH.", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = fitlm("export", out, "--format", "hf", "--out", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    ours = load_model_dir(out / "model").model.eval()
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)
