"""The planner sums its features' terms (fitlm/plan/terms.py, the table in fitlm/plan/features.py): a feature added to
the table shows in `fitlm plan --json` at its moment, under its name and time key, and is searched over, with no
change to the engines. The features' own numbers are held elsewhere (test_plan*.py, the plan-accuracy rows)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from fitlm.config import validate_dict
from fitlm.plan import analytic, features, search, throughput
from fitlm.plan.analytic import breakdown
from fitlm.plan.devices import get_device
from fitlm.plan.report import plan
from fitlm.plan.setup import from_config
from fitlm.plan.terms import Axis, Feature, Owned, Term, Timed

MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 512, "max_seq_len": 64}
MIB = 2**20


def config(**parallel):
    return validate_dict({"model": MODEL, "data": {"seq_length": 64}, "parallel": parallel})


@pytest.fixture
def with_feature(monkeypatch):
    def add(feature: Feature) -> None:
        table = features.FEATURES + (feature,)
        for module in (analytic, throughput, search):
            monkeypatch.setattr(module, "FEATURES", table)

    return add


def test_a_term_counts_at_its_moment_and_is_listed_by_name(with_feature):
    s = from_config(config())
    before = breakdown(s)
    assert before.phase == "forward/backward"
    with_feature(Feature("toy", memory=lambda st: [Term("other", "toy buffer", 3 * MIB, "step")]))
    assert breakdown(s) == before  # a step-only term stays below a forward/backward peak
    with_feature(Feature("toy", memory=lambda st: [Term("other", "toy buffer", 300 * MIB)]))
    grown = breakdown(s)
    assert grown.total == before.total + 300 * MIB
    assert dict(grown.other_parts)["toy buffer"] == 300 * MIB


def test_a_backward_term_can_move_the_peak_to_the_backward_moment(with_feature):
    s = from_config(config())
    loss = breakdown(s)
    with_feature(Feature("toy", memory=lambda st: [Term("activations", "toy backward", 500 * MIB, "backward")]))
    back = breakdown(s)
    assert dict(back.activation_parts)["toy backward"] == 500 * MIB
    assert back.logits == 0 < loss.logits  # the backward moment: logits freed
    assert back.total > loss.total


def test_owned_parameters_leave_the_dense_count_and_the_data_parallel_traffic(with_feature):
    s = from_config(config(data_parallel=4, zero_stage=3))
    dev = get_device("h100-80g")
    before, t0 = breakdown(s), throughput.timing(s, dev)
    n = 100_000
    # As expert parallel over 2 ranks would: a rank holds half of them, whole (ZeRO 0), not a ZeRO-3 quarter
    with_feature(Feature("toy", owned=lambda s, first: Owned(n, n, n / 2, n / 2, replace(s, zero=0))))
    after, t1 = breakdown(s), throughput.timing(s, dev)
    assert after.params == pytest.approx(before.params + (n / 2 - n / 4) * 4, abs=8)  # fp32
    assert after.optimizer == pytest.approx(before.optimizer + (n / 2 - n / 4) * 8, abs=16)  # AdamW's two moments
    assert t1.dp_comm_s < t0.dp_comm_s  # the feature reduces its own parameters (this one: not at all)


def test_time_keys_reach_the_report_and_the_search_turns_an_axis(with_feature):
    @dataclass(frozen=True)
    class Turned:
        seen: list

    seen = Turned([])

    def axis(cfg, lay):
        return Axis("lora_r", [4, 16])

    def time(tc):
        seen.seen.append(tc.s.lora_r)
        return Timed({"toy_comm": 0.25})

    with_feature(Feature("toy", time=time, axis=axis))
    cfg = config()
    dev = get_device("h100-80g")
    result = plan(cfg, dev)
    assert result["time_breakdown_s"]["toy_comm"] == 0.25
    assert result["step_time_s"] >= 0.25
    found = search.candidates(cfg, 2, dev)
    assert {c.setup.lora_r for c in found} == {4, 16}
    assert {4, 16} <= set(seen.seen)
