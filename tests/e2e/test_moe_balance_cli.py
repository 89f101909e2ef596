"""model.moe_balance and model.capacity_factor as a user runs them (`fitlm train` on a tiny Qwen3-MoE): aux_free
adds no loss term (router_aux_loss_coef is not read) and logs its bias, `none` trains as a zero coefficient does,
a resumed aux_free run continues with the checkpointed bias exactly, a capacity logs its dropped share and a roomy
one trains as dropless; the aux_free model/ (saved without its bias, with a warning) exports to transformers with
the logits fitlm computes from model/."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fitlm.models.io import load_model_dir
from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config
from tests.e2e.test_moe_cli import MOE  # the MoE CLI runs' model

FREE = {"moe_balance": "aux_free", "router_bias_update_rate": 0.05}  # large enough to change choices in 3 steps

pytestmark = pytest.mark.process


def train(tiny_corpus, out, model, checkpoint=None) -> tuple[list[dict], str]:
    cfg = tiny_config(
        tiny_corpus,
        out,
        model={**MOE, **model},
        checkpoint=checkpoint or {"interval": 0},
        train={"max_steps": 6, "eval_interval": 0, "warmup_steps": 1},
    )
    proc = fitlm("train", write_config(out.parent / f"{out.name}.yaml", cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r for r in read_metrics(out) if "loss" in r and "step" in r and "eval_loss" not in r], proc.stderr


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("balance")
    out = {"root": root}
    out["free"], out["free_stderr"] = train(
        tiny_corpus, root / "free", {**FREE, "router_aux_loss_coef": 0.5}, {"interval": 3}
    )
    out["free_nocoef"], _ = train(tiny_corpus, root / "free_nocoef", {**FREE, "router_aux_loss_coef": 0.0})
    out["none"], _ = train(tiny_corpus, root / "none", {"moe_balance": "none", "router_aux_loss_coef": 0.5})
    out["plain"], _ = train(tiny_corpus, root / "plain", {"router_aux_loss_coef": 0.0})
    out["resumed"], _ = train(
        tiny_corpus,
        root / "resumed",
        {**FREE, "router_aux_loss_coef": 0.5},
        {"interval": 0, "resume": str(root / "free" / "checkpoints" / "step_00000003")},
    )
    out["tight"], _ = train(tiny_corpus, root / "tight", {"router_aux_loss_coef": 0.0, "capacity_factor": 0.75})
    out["roomy"], _ = train(tiny_corpus, root / "roomy", {"router_aux_loss_coef": 0.0, "capacity_factor": 8.0})
    return out


def losses(records):
    return [r["loss"] for r in records]


def test_aux_free_adds_no_loss_term_and_logs_its_bias(runs):
    assert losses(runs["free"]) == losses(runs["free_nocoef"])  # the coefficient is not read
    assert losses(runs["free"])[0] == losses(runs["plain"])[0]  # a zero bias routes as today
    assert losses(runs["free"])[1:] != losses(runs["plain"])[1:]  # then the bias changes the routing
    for i, r in enumerate(runs["free"], start=1):  # log_interval 1: b moves by ±u a step (sign updates may return to 0)
        assert 0 <= r["router_bias_max"] <= 0.05 * i + 1e-6 and "aux_loss" in r
    assert runs["free"][0]["router_bias_max"] == pytest.approx(0.05)  # after the first step's update
    assert "router_bias_max" not in runs["plain"][0] and "dropped_tokens" not in runs["plain"][0]


def test_none_trains_as_a_zero_coefficient(runs):
    assert losses(runs["none"]) == losses(runs["plain"])


def test_a_resumed_aux_free_run_continues_with_its_bias(runs):
    resumed = {r["step"]: r for r in runs["resumed"]}
    assert sorted(resumed) == [4, 5, 6]
    for r in runs["free"][3:]:
        assert resumed[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-6, abs=1e-7)
        assert resumed[r["step"]]["router_bias_max"] == pytest.approx(r["router_bias_max"], abs=1e-7)


def test_a_capacity_drops_and_logs_and_a_roomy_one_is_dropless(runs):
    assert all(0 < r["dropped_tokens"] < 1 for r in runs["tight"])
    assert losses(runs["tight"]) != losses(runs["plain"])
    assert losses(runs["roomy"]) == losses(runs["plain"])
    assert all(r["dropped_tokens"] == 0 for r in runs["roomy"])


def test_the_aux_free_model_is_saved_without_its_bias_and_exports_to_transformers(runs, tmp_path):
    assert "routes by the unbiased probabilities" in runs["free_stderr"]
    out = runs["root"] / "free"
    proc = fitlm("export", out, "--format", "hf", "--out", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    ours = load_model_dir(out / "model").model.eval()  # built with a zero bias: what model/ holds
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)
