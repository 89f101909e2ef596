"""Routing imbalance in the plan (fitlm/plan/routing.py): an MoE plan carries a worst case beside balanced routing,
its factor from model.capacity_factor, from a measured expert load (`--expert-load`: a number, a profile, a run's
metrics) or the dropless default; the balanced plan is the one the engines computed before. Through the CLI on a
transformers-made Qwen3-MoE with a model section of `init_from` alone. (Against a measured skewed profile:
tests/distributed/test_plan_routing_skew.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fitlm.config import validate_dict
from fitlm.plan.analytic import breakdown
from fitlm.plan.devices import get_device
from fitlm.plan.report import plan
from fitlm.plan.routing import ExpertLoad, ExpertLoadError, read_expert_load, worst_imbalance
from fitlm.plan.setup import from_config
from tests.e2e.helpers import fitlm, hf_qwen3_moe, write_config
from tests.unit.test_plan_expert_parallel import MOE

EP2 = {"data_parallel": 2, "expert_parallel": 2}
TOKENS, K, WIDTH, H = 2 * 64, MOE["num_experts_per_tok"], MOE["moe_intermediate_size"], MOE["hidden_size"]


def _cfg(parallel: dict = EP2, model: dict | None = None, level: str = "O0"):
    return validate_dict(
        {
            "model": {**MOE, **(model or {})},
            "data": {"seq_length": 64},
            "parallel": parallel,
            "train": {"micro_batch_size": 2},
            "memory": {"mixed_precision": level},
        }
    )


def _routing(cfg, load: ExpertLoad | None = None) -> dict:
    return plan(cfg, get_device("a100-80g"), expert_load=load)["routing"]


def test_without_expert_parallel_routing_moves_no_memory():
    for parallel in ({}, {"data_parallel": 2}):
        r = _routing(_cfg(parallel), ExpertLoad(1.8, "a profile"))
        assert r["imbalance"] == 1 and r["worst_case"] == r["balanced"]
        assert "no expert parallel" in r["source"]


def test_the_balanced_plan_is_the_plans_and_the_worst_case_is_the_dropless_bound_by_default():
    cfg = _cfg()
    out = plan(cfg, get_device("a100-80g"))
    r = out["routing"]
    assert r["balanced"] == out["per_device"] == breakdown(from_config(cfg)).as_dict()
    # E 4 over ep 2, top 2: every token of both ranks may choose this rank's 2 experts: twice its own N·k slots
    assert r["imbalance"] == 2 and r["source"].startswith("dropless")
    assert r["worst_case"]["total"] > r["balanced"]["total"]
    assert r["extra_bytes"] == r["worst_case"]["total"] - r["balanced"]["total"]


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_the_worst_case_scales_what_the_receiving_rank_holds(level):
    """Each routed block's received rows (their expert MLP activations, k·I wide, and the gathered rows, H) and
    the all-to-all's receive buffer grow by (factor - 1) times their balanced size; nothing else moves."""
    s = from_config(_cfg(level=level))
    balanced, worst = breakdown(s), breakdown(replace(s, imbalance=1.5))
    act = 4 if level == "O0" else 2
    mlp = s.level_bytes()[3]  # bytes per MLP unit a block saves (fitlm.plan.analytic's f)
    assert worst.activations - balanced.activations == 0.5 * MOE["num_layers"] * TOKENS * K * (mlp * WIDTH + act * H)
    assert worst.other - balanced.other == 0.5 * TOKENS * K * H * act
    assert (worst.params, worst.optimizer, worst.logits) == (balanced.params, balanced.optimizer, balanced.logits)


def test_the_capacity_factor_bounds_the_worst_case():
    # C = ceil(1.25 · N·k · ep / E) per expert, E/ep of them a rank: 1.25 × N·k with N = 128
    r = _routing(_cfg(model={"capacity_factor": 1.25}))
    assert r["imbalance"] == 1.25 and r["source"] == "model.capacity_factor 1.25"
    dropless = _routing(_cfg())
    assert r["balanced"] == dropless["balanced"]
    assert r["balanced"]["total"] < r["worst_case"]["total"] < dropless["worst_case"]["total"]
    # a capacity above the dropless bound bounds nothing; one below 1 leaves the balanced plan
    assert _routing(_cfg(model={"capacity_factor": 4.0}))["source"].startswith("dropless")
    low = _routing(_cfg(model={"capacity_factor": 0.5}))
    assert low["imbalance"] == 1 and low["worst_case"] == low["balanced"]


def test_a_capacity_that_does_not_divide_rounds_up_per_expert():
    s = from_config(_cfg(model={"capacity_factor": 1.01}))
    # C = ceil(1.01 · 128 · 2 · 2 / 4) = 130 slots per expert, 2 experts a rank, over N·k = 256
    assert worst_imbalance(s, None)[0] == 2 * 130 / 256


def test_a_measured_expert_load_sets_the_worst_case_below_the_bounds():
    cfg = _cfg(model={"capacity_factor": 1.75})
    loads = {f: _routing(cfg, ExpertLoad(f, "profile.json")) for f in (1.2, 1.5, 3.0)}
    assert [loads[f]["imbalance"] for f in loads] == [1.2, 1.5, 1.75]  # a load above the capacity: the capacity's
    assert loads[1.2]["source"] == "expert load 1.2 from profile.json"
    assert loads[1.2]["expert_load"] == {"factor": 1.2, "source": "profile.json"}
    totals = [loads[f]["worst_case"]["total"] for f in loads]
    assert loads[1.2]["balanced"]["total"] < totals[0] < totals[1] < totals[2]


def test_expert_load_is_read_from_a_number_a_profile_or_a_runs_metrics(tmp_path):
    assert read_expert_load("1.5") == ExpertLoad(1.5, "--expert-load")
    profile = tmp_path / "profile"
    profile.mkdir()
    ranks = [{"rank": 0, "expert_load": 1.25}, {"rank": 1, "expert_load": 1.75}]
    (profile / "profile.json").write_text(json.dumps({"expert_load": 1.5, "per_rank": ranks}))
    assert read_expert_load(str(profile)) == ExpertLoad(1.75, str(profile / "profile.json"))
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"step": 1, "loss": 3.0, "expert_load": 1.3},
        {"step": 2, "eval_loss": 3.1},
        {"step": 3, "expert_load": 1.6},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read_expert_load(str(run)).factor == 1.6
    assert read_expert_load(str(run / "metrics.jsonl")).factor == 1.6


def test_a_bad_expert_load_names_the_input_and_the_fix(tmp_path):
    (tmp_path / "dense.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "empty").mkdir()
    cases = {
        "0.5": "at least 1",
        "nan": "at least 1",
        str(tmp_path / "missing.json"): "no such file and not a number",
        str(tmp_path / "dense.jsonl"): "no `expert_load` in it",
        str(tmp_path / "broken.json"): "not JSON",
        str(tmp_path / "empty"): "holds neither profile.json nor metrics.jsonl",
    }
    for value, says in cases.items():
        with pytest.raises(ExpertLoadError, match="--expert-load") as err:
            read_expert_load(value)
        assert says in str(err.value), (value, str(err.value))


@pytest.mark.process
def test_fitlm_plan_prints_balanced_and_worst_case_routing_for_an_init_from_checkpoint(tmp_path):
    hf = hf_qwen3_moe(tmp_path / "hf", seed=0)  # 6 experts, top 2, a dense block among two routed ones
    config = write_config(
        tmp_path / "cfg.yaml",
        {"model": {"init_from": str(hf)}, "data": {"seq_length": 64}, "parallel": EP2, "train": {"device": "cpu"}},
    )
    (tmp_path / "profile.json").write_text(json.dumps({"expert_load": 1.5}))
    runs = {
        "default": fitlm("plan", config, "--json"),
        "capacity": fitlm("plan", config, "--json", "--set", "model.capacity_factor=1.25"),
        "profile": fitlm("plan", config, "--json", "--expert-load", tmp_path / "profile.json"),
    }
    routing = {}
    for name, proc in runs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        routing[name] = out["routing"]
        assert out["routing"]["balanced"] == out["per_device"]
    assert routing["default"]["imbalance"] == 2  # ep 2 · min(k 2, E/ep 3) / k
    assert routing["capacity"]["imbalance"] == pytest.approx(1.25, abs=0.01)  # (C rounded up: E/ep 3 over ep 2)
    assert routing["profile"]["imbalance"] == 1.5
    worst = {name: r["worst_case"]["total"] for name, r in routing.items()}
    assert routing["default"]["balanced"]["total"] < worst["capacity"] < worst["profile"] < worst["default"]
    text = fitlm("plan", config, "--expert-load", "1.5")
    assert text.returncode == 0, text.stderr[-3000:]
    assert "worst-case routing" in text.stderr and "receive 1.5× their balanced rows" in text.stderr
    bad = fitlm("plan", config, "--expert-load", tmp_path / "nothing.json")
    assert bad.returncode != 0 and "--expert-load" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.process
def test_a_profile_records_the_expert_load_that_plan_reads(tiny_corpus, tmp_path):
    from fitlm.profile.burst import run_burst
    from fitlm.profile.report import assemble, write_json
    from tests.e2e.helpers import tiny_config

    cfg = validate_dict(tiny_config(tiny_corpus, tmp_path / "run", model=MOE, train={"micro_batch_size": 2}))
    ranks = run_burst(cfg, 2, tmp_path / "out")
    assert ranks is not None
    result = assemble(cfg, "cfg.yaml", 2, ranks, {})
    assert 1 <= result["expert_load"] <= MOE["num_experts"] / K  # max / mean slots per expert over the steps
    assert result["expert_load"] == ranks[0]["expert_load"]
    write_json(result, tmp_path / "out")
    assert read_expert_load(str(tmp_path / "out")) == ExpertLoad(
        result["expert_load"], str(tmp_path / "out" / "profile.json")
    )
