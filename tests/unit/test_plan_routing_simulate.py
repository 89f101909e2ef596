"""`fitlm plan --simulate`'s worst-case routing under expert parallel (fitlm.parallel.expert_parallel's
`ExpertParallelDispatch._simulated`): the fake step runs again with the simulated rank's experts receiving the plan's
worst-case factor times their balanced rows, capped as routing allows, and `routing.simulated_worst_case` holds its
peak beside the balanced simulation. Through the CLI on a transformers-made Qwen3-MoE with a model section of
`init_from` alone. (Against a measured skewed profile: tests/distributed/test_plan_routing_skew.py.)"""

from __future__ import annotations

import json

import pytest

from fitlm.parallel.expert_parallel import ExpertParallelDispatch
from fitlm.plan.devices import get_device
from fitlm.plan.report import plan
from fitlm.plan.routing import ExpertLoad
from tests.e2e.helpers import fitlm, hf_qwen3_moe, write_config
from tests.unit.test_plan_routing import EP2, _cfg

TOKENS = 2 * 64  # a rank's N: micro batch 2 × 64


def _simulated(model: dict | None = None, load: ExpertLoad | None = None, parallel: dict = EP2) -> dict:
    out = plan(_cfg(parallel, model), get_device("a100-80g"), simulate=True, expert_load=load)
    assert "error" not in out["simulated"], out["simulated"]
    return out


def test_the_simulated_worst_case_grows_with_the_factor_and_moves_only_the_received_rows():
    """Dropless (2), a capacity (1.5) and a measured load (1.3): the simulated step's bytes over the balanced one
    grow as (factor - 1), the received rows' share (a simulation that ignored the factor gives 0 for each)."""
    runs = {2.0: _simulated(), 1.5: _simulated({"capacity_factor": 1.5}), 1.3: _simulated(load=ExpertLoad(1.3, "x"))}
    per_unit = []
    for factor, out in runs.items():
        balanced, worst = out["simulated"]["per_device"], out["routing"]["simulated_worst_case"]
        assert out["routing"]["imbalance"] == factor
        assert worst["total"] > balanced["total"]
        for part in ("params", "grads", "optimizer"):  # the experts' weights and states stay where they are
            assert worst[part] == balanced[part], part
        per_unit.append((worst["total"] - balanced["total"]) / (factor - 1))
    # (rows are whole: 1.3 × 512 rounds to 666; the rest are exact)
    assert per_unit == pytest.approx([per_unit[0]] * 3, rel=0.01), per_unit
    # the balanced simulation is the same step whatever the worst case
    assert runs[2.0]["simulated"]["per_device"] == runs[1.3]["simulated"]["per_device"]


def test_without_a_worst_case_there_is_no_simulated_one():
    assert "simulated_worst_case" not in _simulated(parallel={"data_parallel": 2})["routing"]  # no expert parallel
    assert "simulated_worst_case" not in _simulated(load=ExpertLoad(1.0, "balanced"))["routing"]
    assert "simulated_worst_case" not in plan(_cfg(), get_device("a100-80g"))["routing"]  # without --simulate


@pytest.mark.parametrize(
    "capacity, imbalance, k, rows",
    [
        (None, 1.0, 2, 512),  # balanced: the ep group's even split, N·k = 512, half from each of the 2 ranks
        (None, 1.5, 2, 768),
        (None, 10.0, 2, 1024),  # at most every token of the group choosing 2 of this rank's 2 experts
        (None, 10.0, 1, 512),  # top 1: each token brings one slot at most
        (1.25, 10.0, 2, 640),  # C = ceil(1.25 · 1024 / 4) = 320 slots per expert, 2 experts
        (3.0, 10.0, 2, 1024),  # a capacity above the dropless bound bounds nothing
    ],
)
def test_the_simulated_rank_receives_at_most_what_routing_can_bring(capacity, imbalance, k, rows):
    """`_received`, with the same bounds as the analytic worst case (fitlm.plan.routing): ep 2, 4 experts (2 a
    rank), N = 256 tokens a rank."""
    dispatch = ExpertParallelDispatch(None, 2, capacity)  # type: ignore[arg-type]  # (no group: no collective)
    dispatch.imbalance = imbalance
    assert dispatch._received(256 * k, 256, k, 2) == rows


@pytest.mark.process
@pytest.mark.slow  # two fake steps in a CLI process: about 20 s on 2 cores
def test_fitlm_plan_simulate_shows_the_simulated_worst_case_for_an_init_from_checkpoint(tmp_path):
    hf = hf_qwen3_moe(tmp_path / "hf", seed=0)  # 6 experts, top 2, a dense block among two routed ones
    config = write_config(
        tmp_path / "cfg.yaml",
        {"model": {"init_from": str(hf)}, "data": {"seq_length": 64}, "parallel": EP2, "train": {"device": "cpu"}},
    )
    proc = fitlm("plan", config, "--json", "--simulate", "--expert-load", "1.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    routing = out["routing"]
    assert routing["imbalance"] == 1.5
    assert routing["simulated_worst_case"]["total"] > out["simulated"]["per_device"]["total"]
    text = fitlm("plan", config, "--simulate", "--expert-load", "1.5")
    assert text.returncode == 0, text.stderr[-3000:]
    header = next(line for line in text.stderr.splitlines() if "analytic" in line)
    for column in ("simulated", "worst-case routing", "worst case, simulated"):
        assert column in header, header
    assert "(fits; simulated " in text.stderr
