"""Run trackers beside metrics.jsonl: TensorBoard, Weights & Biases and MLflow (`train.observe.report_to`).

Each receives the scalars of every metrics.jsonl record (tags as `fitlm.train.metrics.scalars` names them),
guard and warning messages as text, and the resolved config once at the start. W&B runs offline by default:
its files go under output_dir/wandb and `wandb sync output_dir/wandb/offline-run-*` uploads them later.
MLflow logs to output_dir/mlruns (its file store) unless `mlflow_tracking_uri` names another store or server.
The W&B run id and the MLflow run id are kept in output_dir/trackers.json, so a resumed run continues the same
tracker runs. A tracker is imported only when asked for; a missing one is refused before the run starts
(fitlm.rules). One that fails while training is dropped with a warning: training never stops for a tracker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Literal, Protocol, Sequence

TRACKERS = ("tensorboard", "wandb", "mlflow")
IDS_FILE = "trackers.json"


class Tracker(Protocol):
    name: str

    def scalars(self, step: int, values: Iterable[tuple[str, float]]) -> None: ...

    def text(self, step: int, tag: str, text: str) -> None: ...

    def close(self) -> None: ...


def tracker_names(report_to: Sequence[str] | None, tensorboard: str | bool, installed: bool) -> list[str]:
    """The trackers a run writes to: `report_to` when given, else TensorBoard as `train.observe.tensorboard` says."""
    if report_to is not None:
        return list(dict.fromkeys(report_to))
    return ["tensorboard"] if tensorboard is True or (tensorboard == "auto" and installed) else []


class TensorBoard:
    name = "tensorboard"

    def __init__(self, output_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(output_dir / "tensorboard"))
        self._w.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def scalars(self, step: int, values: Iterable[tuple[str, float]]) -> None:
        for tag, value in values:
            self._w.add_scalar(tag, value, step)
        self._w.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        self._w.add_text(tag, text, step)

    def close(self) -> None:
        self._w.close()


class Wandb:
    name = "wandb"

    def __init__(
        self,
        output_dir: Path,
        config: dict[str, Any],
        run_id: str | None,
        project: str,
        mode: Literal["offline", "online"],
    ):
        import wandb

        self._run = wandb.init(
            project=project,
            dir=str(output_dir),
            mode=mode,
            config=config,
            name=output_dir.name,
            id=run_id,
            resume="allow",
            reinit="create_new",
        )
        self.run_id = self._run.id

    def scalars(self, step: int, values: Iterable[tuple[str, float]]) -> None:
        self._run.log(dict(values), step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self._run.log({tag: text}, step=step)

    def close(self) -> None:
        self._run.finish()


class Mlflow:
    name = "mlflow"

    def __init__(self, output_dir: Path, config: dict[str, Any], run_id: str | None, uri: str | None, experiment: str):
        from mlflow.tracking import MlflowClient

        uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or (output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps its file store only on request ("maintenance mode")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            exp = client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
            run_id = client.create_run(exp_id, run_name=output_dir.name).info.run_id
            self._log_config(run_id, config)
        else:
            client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def _log_config(self, run_id: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        from fitlm.rules import flatten

        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flatten(config).items()]
        params = [Param(p.key, p.value[:500]) for p in params]  # MLflow's limit on a parameter's value
        for i in range(0, len(params), 100):  # and on one batch
            self._client.log_batch(run_id, params=params[i : i + 100])
        self._client.log_dict(run_id, config, "config.json")

    def scalars(self, step: int, values: Iterable[tuple[str, float]]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in values]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def text(self, step: int, tag: str, text: str) -> None:
        self._client.log_text(self.run_id, text, f"events/step{step:08d}-{tag.replace('/', '_')}.txt")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def open_trackers(names: list[str], output_dir: Path, config: dict[str, Any], observe: Any) -> list[Tracker]:
    """Start the named trackers for a run in `output_dir` (continuing the runs named in trackers.json)."""
    ids_path = output_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    out: list[Tracker] = []
    for name in names:
        try:
            if name == "tensorboard":
                out.append(TensorBoard(output_dir, config))
            elif name == "wandb":
                out.append(Wandb(output_dir, config, ids.get("wandb"), observe.wandb_project, observe.wandb_mode))
            else:
                out.append(
                    Mlflow(
                        output_dir, config, ids.get("mlflow"), observe.mlflow_tracking_uri, observe.mlflow_experiment
                    )
                )
        except Exception as e:  # before any step: stop with what failed and where it is configured
            for started in out:
                started.close()
            raise RuntimeError(
                f"train.observe.report_to: the {name} tracker did not start ({type(e).__name__}: "
                f"{e}); fix its train.observe settings or remove it from report_to"
            ) from e
        if hasattr(out[-1], "run_id"):
            ids[name] = out[-1].run_id
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return out


__all__ = ["IDS_FILE", "TRACKERS", "Mlflow", "TensorBoard", "Tracker", "Wandb", "open_trackers", "tracker_names"]
