"""train.observe.guards: NaN/Inf and spiking steps are skipped, stop the run, or roll it back, identically on every rank;
and the run observers around them (input balance, TensorBoard, profiler window, config rules)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fitlm.config import ConfigError, GuardsConfig, validate_dict
from fitlm.step.guards import StepGuards, TrainingDiverged
from fitlm.train.balance import InputMonitor, batch_counts
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import read_metrics, tiny_config

STEPS = 8
SPIKE = {"spike": "skip", "warmup_steps": 3, "window": 10, "loss_spike_sigma": 3.0, "grad_spike_sigma": 0.0}


def make(tiny_corpus, tmp_path, guards=None, checkpoint=None, **train) -> Trainer:
    observe = {
        "tensorboard": False,
        "guards": guards or {},
        **{k: train.pop(k) for k in ("tensorboard", "profile_steps") if k in train},
    }
    train = {"max_steps": STEPS, "eval_interval": 0, "observe": observe, **train}
    return Trainer(validate_dict(tiny_config(tiny_corpus, tmp_path / "out", train=train, checkpoint=checkpoint or {})))


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.pm.model.named_parameters()}


def inject(trainer: Trainer, calls: set[int], factor: float) -> dict:
    """Multiply the loss (and so the gradients) of the given train_step calls (1-based) by `factor`;
    records the weights around the first of them."""
    real_step, real_loss = trainer.train_step, trainer.step.loss_sum
    seen = {"call": 0}

    def loss_sum(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        return out * factor if seen["call"] in calls else out

    def train_step(step, batches):
        seen["call"] += 1
        first = seen["call"] == min(calls)
        if first:
            seen["before"] = weights(trainer)
        out = real_step(step, batches)
        if first:
            seen["after"] = weights(trainer)
        return out

    trainer.step.loss_sum, trainer.train_step = loss_sum, train_step
    return seen


def guard_records(out_dir) -> list[dict]:
    return [r for r in read_metrics(out_dir) if "guard" in r]


def assert_unchanged(seen: dict) -> None:
    for name, before in seen["before"].items():
        assert torch.equal(before, seen["after"][name]), name


def test_injected_nan_is_skipped_weights_untouched_and_training_finishes(tiny_corpus, tmp_path, capsys):
    trainer = make(tiny_corpus, tmp_path)
    seen = inject(trainer, {3}, float("nan"))
    result = trainer.fit()
    assert result.steps == STEPS and math.isfinite(result.last_loss)
    assert_unchanged(seen)
    [record] = guard_records(tmp_path / "out")
    assert record["step"] == 3 and record["guard"] == "nonfinite" and record["action"] == "skip"
    assert "loss is nan" in record["reason"]
    assert "step 3" in capsys.readouterr().err
    steps = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in steps][-1] == STEPS and all(math.isfinite(r["loss"]) for r in steps if r["step"] != 3)


def test_spike_with_skip_policy_is_skipped(tiny_corpus, tmp_path):
    trainer = make(tiny_corpus, tmp_path, guards=SPIKE)
    seen = inject(trainer, {5}, 50.0)
    assert trainer.fit().steps == STEPS
    assert_unchanged(seen)
    [record] = guard_records(tmp_path / "out")
    assert (record["step"], record["guard"], record["action"]) == (5, "loss_spike", "skip")
    assert "standard deviations" in record["reason"]


def test_spike_with_stop_policy_stops_naming_step_and_reason(tiny_corpus, tmp_path):
    trainer = make(tiny_corpus, tmp_path, guards={**SPIKE, "spike": "stop"})
    seen = inject(trainer, {5}, 50.0)
    with pytest.raises(TrainingDiverged, match=r"step 5: loss spike.*not applied") as err:
        trainer.fit()
    assert "Loss spikes" in str(err.value)
    assert_unchanged(seen)
    assert guard_records(tmp_path / "out")[0]["action"] == "stop"


@pytest.mark.process
def test_spike_with_rollback_policy_reloads_the_checkpoint_and_continues(tiny_corpus, tmp_path):
    trainer = make(
        tiny_corpus, tmp_path, guards={**SPIKE, "spike": "rollback", "rollback_after": 2}, checkpoint={"interval": 2}
    )
    inject(trainer, {5, 6}, 50.0)  # two bad steps in a row: the first is skipped, the second rolls back
    assert trainer.fit().steps == STEPS
    records = guard_records(tmp_path / "out")
    assert [(r["step"], r["action"]) for r in records] == [(5, "skip"), (6, "rollback")]
    assert records[1]["restored_step"] == 4
    steps = [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert steps[-1] == STEPS and steps.count(5) == 2  # step 5 trained again after the rollback


def test_rollback_without_a_checkpoint_stops_and_says_so(tiny_corpus, tmp_path):
    trainer = make(
        tiny_corpus, tmp_path, guards={"nonfinite": "rollback", "rollback_after": 1}, checkpoint={"interval": 100}
    )
    inject(trainer, {2}, float("nan"))
    with pytest.raises(TrainingDiverged, match="none was written yet"):
        trainer.fit()


def test_guards_agree_with_the_most_severe_rank_and_count_streaks():
    worst = {"value": 0}

    def reduce_max(t):  # another rank may report a worse verdict
        return torch.maximum(t, torch.tensor([worst["value"]]))

    g = StepGuards(GuardsConfig(nonfinite="rollback", rollback_after=2, max_rollbacks=1), reduce_max)
    one = torch.tensor(1.0)
    assert g.inspect(1, one, one) is None
    worst["value"] = 3  # "rollback" elsewhere: this rank follows, as a skip until the streak is long enough
    event = g.inspect(2, one, one)
    assert event.action == "skip" and "another rank" in event.reason
    worst["value"] = 0
    assert g.inspect(3, torch.tensor(float("inf")), one).action == "rollback"
    g.rolled_back()
    g.inspect(4, torch.tensor(float("nan")), one)
    assert g.inspect(5, torch.tensor(float("nan")), one).action == "stop"  # max_rollbacks spent


def test_spike_statistics_warm_up_and_floor():
    g = StepGuards(GuardsConfig(warmup_steps=3, window=5, loss_spike_sigma=3.0, grad_spike_sigma=0.0), lambda t: t)
    for _ in range(3):
        assert g.classify(2.0, 1.0) == ("", "")
        g._accept(2.0, 1.0)
    assert g.classify(2.05, 1.0) == ("", "")  # a flat curve: the deviation is floored at 1% of the mean
    kind, reason = g.classify(2.5, 1.0)
    assert kind == "loss_spike" and "running mean 2" in reason
    state = g.state_dict()
    h = StepGuards(GuardsConfig(warmup_steps=3, window=5), lambda t: t)
    h.load_state_dict(json.loads(json.dumps(state)))
    assert h.classify(2.5, 1.0)[0] == "loss_spike"
    assert StepGuards(GuardsConfig(warmup_steps=0), lambda t: t).classify(2.0, 1.0) == ("", "")  # no statistics yet


def test_batch_counts_and_balance_warning():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0, 0]]),
        "labels": torch.tensor([[6, 7, -100, -100, -100]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4]]),
    }
    assert batch_counts(batch, pad_id=0) == (2, 5, 2, 3)
    monitor = InputMonitor(ctx=None, pad_id=0, balance_threshold=1.5, wait_threshold=0.1)
    even = [[100, 500, 0, 64, 0.0, 1.0], [110, 500, 0, 64, 0.0, 1.0]]
    assert monitor._balance_warning(10, even) is None
    skewed = [[100, 500, 0, 64, 0.0, 1.0], [100, 500, 0, 400, 0.0, 1.0]]
    warning = monitor._balance_warning(10, skewed)
    assert warning["dp_rank"] == 1 and "longest document" in warning["message"]
    assert monitor._balance_warning(11, skewed) is None  # not repeated on the next log line
    wait = monitor._wait_warning(10, [[0, 0, 0, 0, 0.3, 1.0]])
    assert wait["warning"] == "data_wait" and "30%" in wait["message"]


@pytest.mark.process
def test_metrics_carry_input_fields_tensorboard_and_profiler_trace(tiny_corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    make(tiny_corpus, tmp_path, max_steps=3, tensorboard=True, profile_steps=[2, 3]).fit()
    out = tmp_path / "out"
    record = [r for r in read_metrics(out) if "loss" in r][-1]
    assert 0 <= record["data_wait_share"] <= 1 and {"data", "forward", "backward", "optimizer"} <= set(
        record["step_seconds"]
    )
    assert record["target_tokens"][0] > 0 and record["padding_share"] == [0.0]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [1, 2, 3] and losses[-1].value == pytest.approx(record["loss"], rel=1e-6)
    trace = json.loads((out / "profile" / "trace_rank0.json").read_text())
    assert trace["traceEvents"]


def test_observer_config_rules_name_their_keys(monkeypatch, tiny_corpus, tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_dict(
            {
                "train": {
                    "observe": {
                        "guards": {"spike": "rollback", "window": 1},
                        "profile_steps": [5, 2],
                        "balance_threshold": 0.5,
                        "consistency_interval": -1,
                    }
                }
            }
        )
    text = str(err.value)
    for key in (
        "train.observe.guards.window",
        "train.observe.guards.spike",
        "train.observe.profile_steps",
        "train.observe.balance_threshold",
        "train.observe.consistency_interval",
    ):
        assert key in text
    monkeypatch.setattr("fitlm.rules.tensorboard_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"train.observe.tensorboard: true.*pip install tensorboard"):
        make(tiny_corpus, tmp_path, tensorboard=True)


def test_sections_named_by_messages_exist_in_troubleshooting(tiny_corpus, tmp_path):
    """Every section a real message points at is a heading of docs/troubleshooting.md (the messages are made,
    not listed, so a renamed heading or a new pointer cannot slip past)."""
    import re
    from pathlib import Path

    from fitlm.step.guards import GuardEvent
    from fitlm.train.consistency import DOCS as CONSISTENCY_DOCS
    from fitlm.train.oom import TrainingOutOfMemory, oom_guard

    headings = {
        line[3:].strip()
        for line in (Path(__file__).parents[2] / "docs" / "troubleshooting.md").read_text().splitlines()
        if line.startswith("## ")
    }
    messages = [GuardEvent(1, kind, "r", "skip").message() for kind in ("nonfinite", "loss_spike", "grad_spike", "")]
    monitor = InputMonitor(ctx=None, pad_id=0, balance_threshold=1.5, wait_threshold=0.1)
    messages.append(monitor._balance_warning(1, [[100, 1, 0, 1, 0, 1], [400, 1, 0, 1, 0, 1]])["message"])
    messages.append(monitor._wait_warning(1, [[0, 0, 0, 0, 0.5, 1.0]])["message"])
    cfg = validate_dict(tiny_config(tiny_corpus, tmp_path / "out"))
    with pytest.raises(TrainingOutOfMemory) as oom:
        with oom_guard(cfg, "forward/backward", 0, torch.device("cpu")):
            raise torch.OutOfMemoryError("out of memory")
    messages.append(str(oom.value))
    messages.append(CONSISTENCY_DOCS)  # the RanksDiverged message ends with it (tests/distributed/test_consistency)
    named = {m for text in messages for m in re.findall(r'section "([^"]+)"', text)}
    assert len(named) >= 5, named  # nonfinite, spikes, balance, input wait, OOM, ranks
    assert named <= headings, named - headings
    for text in messages:
        assert "docs/troubleshooting.md" in text, text


def test_oom_snapshot_is_cuda_only_and_lets_the_error_through(tmp_path):
    from fitlm.train.trace import OOMSnapshot

    snapshot = OOMSnapshot(True, tmp_path, 0, torch.device("cpu"))
    assert not snapshot.enabled  # allocator history exists on CUDA only
    with pytest.raises(torch.OutOfMemoryError):
        with snapshot.on_oom():
            raise torch.OutOfMemoryError("out of memory")
    assert not list(tmp_path.iterdir())
