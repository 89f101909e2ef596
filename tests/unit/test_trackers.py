"""train.observe.report_to: the same scalars and the resolved config in TensorBoard, W&B (offline) and MLflow (file
store), read back through each library's own reader; a resumed run continues the same tracker runs; a tracker
that breaks mid-run is dropped with a warning and training goes on (fitlm/train/trackers.py, train/metrics.py)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from fitlm.config import validate_dict
from fitlm.train.metrics import MetricsLog
from fitlm.train.trackers import IDS_FILE, Mlflow
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import read_metrics, tiny_config

ALL = ["tensorboard", "wandb", "mlflow"]


def train(tiny_corpus, out: Path, steps: int, **observe) -> Trainer:
    cfg = tiny_config(
        tiny_corpus,
        out,
        train={"max_steps": steps, "eval_interval": 0, "observe": {"report_to": ALL, **observe}},
        checkpoint={"interval": 2},
    )
    trainer = Trainer(validate_dict(cfg))
    trainer.fit()
    return trainer


def wandb_records(run_dir: Path):
    """The records of a W&B offline run file, as wandb's own protobuf messages. The file is W&B's record log
    (a ':W&B' header, then 32 KiB blocks of chunks: crc32c, length, type FULL/FIRST/MIDDLE/LAST, bytes);
    wandb 0.2x dropped its Python reader, so the framing is read here and each record parsed by wandb."""
    from wandb.proto import wandb_internal_pb2 as pb

    for path in sorted(run_dir.glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        pos, block, parts = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
                pos += block - pos % block
                continue
            length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
            parts += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a record is complete
                record = pb.Record()
                record.ParseFromString(parts)
                parts = b""
                yield record


def wandb_history(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict[str, str], set[str]]:
    """({step: {key: value}}, {config key: JSON value}, run ids) of every offline run file under run_dir."""
    import json

    history: dict[int, dict[str, float]] = {}
    config: dict[str, str] = {}
    ids: set[str] = set()
    for r in wandb_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item}
            step = int(items.pop("_step"))
            history.setdefault(step, {}).update({k: json.loads(v) for k, v in items.items() if not k.startswith("_")})
        elif kind == "config":
            config.update({u.key: u.value_json for u in r.config.update})
        elif kind == "run":  # the config given to wandb.init travels in the run record
            ids.add(r.run.run_id)
            config.update({u.key: u.value_json for u in r.run.config.update})
    return history, config, ids


def mlflow_client(out: Path):
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())


@pytest.mark.process
def test_every_tracker_gets_the_metrics_and_the_config_and_a_resume_continues_them(tiny_corpus, tmp_path):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    train(tiny_corpus, out, 2)
    first_ids = json.loads((out / IDS_FILE).read_text())
    train(tiny_corpus, out, 4)  # resumes from the step-2 checkpoint
    assert json.loads((out / IDS_FILE).read_text()) == first_ids
    logged = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    assert sorted(logged) == [1, 2, 3, 4]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx({s: r["loss"] for s, r in logged.items()})

    history, config, ids = wandb_history(out / "wandb")
    assert ids == {first_ids["wandb"]}  # both offline run files are the one W&B run (synced into one)
    for step, record in logged.items():
        assert history[step]["loss"] == pytest.approx(record["loss"])
        assert history[step]["step_seconds/optimizer"] == pytest.approx(record["step_seconds"]["optimizer"])
    assert json.loads(config["train"])["lr"] == 1e-2 and json.loads(config["model"])["hidden_size"] == 64

    client = mlflow_client(out)
    run = client.get_run(first_ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "out"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == pytest.approx(
        {s: r["loss"] for s, r in logged.items()}
    )
    assert run.data.params["train.lr"] == "0.01" and run.data.params["model.arch"] == "llama"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_tracker_that_breaks_mid_run_is_dropped_with_a_warning(tmp_path, capsys):
    tracker = Mlflow(tmp_path, {"train": {"lr": 0.1}}, None, None, "fitlm")
    log = MetricsLog(tmp_path / "metrics.jsonl", [tracker])
    log.write({"step": 1, "loss": 2.0})
    shutil.rmtree(tmp_path / "mlruns")
    (tmp_path / "mlruns").write_text("not a store any more")  # the store is gone from under the run
    log.write({"step": 2, "loss": 1.5})  # must not raise
    log.write({"step": 3, "loss": 1.0})
    log.close()
    records = read_metrics(tmp_path)
    assert [r.get("loss") for r in records if "loss" in r] == [2.0, 1.5, 1.0]  # metrics.jsonl kept everything
    warnings = [r for r in records if r.get("warning") == "tracker_failed"]
    assert len(warnings) == 1 and warnings[0]["step"] == 2 and warnings[0]["tracker"] == "mlflow"
    assert "the mlflow tracker failed" in capsys.readouterr().err
    assert log.trackers == []


@pytest.mark.process
def test_a_tracker_that_does_not_start_names_the_key(tiny_corpus, tmp_path):
    with pytest.raises(RuntimeError, match=r"train.observe.report_to: the mlflow tracker did not start"):
        train(tiny_corpus, tmp_path / "out", 1, mlflow_tracking_uri="nosuchscheme://x")
