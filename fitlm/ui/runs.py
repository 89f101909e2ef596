"""The runs `fitlm ui` lists: every training output (or profile) directory under RUNS_DIR, its state and metrics.

Model directories under RUNS_DIR (`fitlm import`, `export --format hf`, `merge`, `ckpt merge`: a fitlm.json or
a config.json beside the weights) are not runs: they hold a config.yaml but never trained there, so listing them
would show each as a crashed run at step 0. The Chat and Export views offer them (fitlm.ui.chat.chat_models).

A run's state comes from its run lock (fitlm.train.run_lock.lock_status), read without taking it:
`running` while the lock is held, `finished` / `stopped` (SIGTERM, a checkpoint saved) / `failed` as the run
recorded when it let go, `crashed` when its holder died without letting go (killed, out of host memory).
Directories of earlier fitlm versions, which recorded no outcome, are judged by what they hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fitlm.checkpoint.store import checkpoints_root, list_checkpoints
from fitlm.eval.results import score_rows
from fitlm.models.io import MARKER
from fitlm.train.run_lock import lock_status
from fitlm.ui.errors import UIError

# What makes a directory a run (or a `fitlm profile` report) for the list.
MARKERS = ("metrics.jsonl", "config.yaml", ".fitlm-run.lock", "profile.json")
MAX_DEPTH = 3  # RUNS_DIR/a/b/c: runs are looked for this deep, so a tree of experiments is listed too
STATE_OF = {"abandoned": "crashed"}


class RunNotFound(UIError):
    """A run name that is not a run directory under RUNS_DIR (or climbs out of it)."""


def run_dir(root: Path, name: str) -> Path:
    """RUNS_DIR/name, refused unless it is a run directory inside RUNS_DIR."""
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()) or not _is_run(path):
        raise RunNotFound(
            f"{name}: no run of that name under {root} (a run is a train.output_dir holding metrics.jsonl or "
            "config.yaml; a model directory is chosen in the Chat or Export view); pick one from the Runs list"
        )
    return path


# What makes a directory a model rather than a run: a fitlm model directory's completion marker, or Hugging Face's
# config (neither of which `fitlm train` writes at the top of its output directory).
MODEL_MARKERS = (MARKER, "config.json")


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in MODEL_MARKERS)


def _is_run(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in MARKERS) and not is_model_dir(path)


def find_runs(root: Path) -> list[Path]:
    """Run directories under `root`, newest first (a run's own subdirectories are not searched)."""
    found: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        if _is_run(d) and d != root:
            found.append(d)
            return
        if depth >= MAX_DEPTH or is_model_dir(d):  # (a model directory holds no runs)
            return
        try:
            children = sorted(d.iterdir()) if d.is_dir() else []
        except OSError:  # unreadable: not ours to list
            return
        for child in children:
            if child.is_dir() and not child.name.startswith("."):
                walk(child, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return sorted(found, key=lambda p: _mtime(p), reverse=True)


def _mtime(p: Path) -> float:
    return max((p / m).stat().st_mtime for m in MARKERS if (p / m).exists())


def state(path: Path) -> str:
    """running, finished, stopped, failed or crashed (see the module docstring)."""
    status, _ = lock_status(path)
    if status in ("released", "none"):  # written by a fitlm that recorded no outcome, or a profile
        if (path / "model").is_dir() or (path / "profile.json").is_file():
            return "finished"
        return "stopped" if list_checkpoints(checkpoints_root(path)) else "crashed"
    return STATE_OF.get(status, status)


def read_records(path: Path, since: int = 0, name: str = "metrics.jsonl") -> tuple[list[dict[str, Any]], int]:
    """`name`'s records (metrics.jsonl, rollouts.jsonl) from byte `since` on, and the byte to read from next: the end
    of the last complete line (a half-written last line waits for its newline). Polling reads only what is new."""
    f = path / name
    if not f.is_file():
        return [], since
    with open(f, "rb") as fh:
        fh.seek(since)
        chunk = fh.read()
    end = chunk.rfind(b"\n") + 1  # 0 when no line is complete yet
    out = []
    for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
        try:
            # NaN / Infinity (a diverged loss, an overflowed step) become null: JSON has no such numbers
            record = json.loads(line, parse_constant=lambda _: None)
        except ValueError:
            continue  # a line torn by a crash: skipped, the rest still charts
        if isinstance(record, dict):
            out.append(record)
    return out, since + end


TAIL_BYTES = 1 << 16  # the end of metrics.jsonl a summary reads: the last step and eval records are there


def _last_records(path: Path) -> list[dict[str, Any]]:
    f = path / "metrics.jsonl"
    if not f.is_file():
        return []
    start = max(f.stat().st_size - TAIL_BYTES, 0)
    records, _ = read_records(path, start)
    return records  # (a first line cut by the seek fails to parse and is skipped)


ROLLOUT_TAIL_BYTES = 1 << 20  # the end of rollouts.jsonl (GRPO's train.observe.log_completions) a run's page reads
ROLLOUT_ROWS = 64


def rollouts(path: Path) -> dict[str, Any] | None:
    """The completions of the last step rollouts.jsonl holds (at most ROLLOUT_ROWS, the last ones), with their
    columns in the file's order; None when the run logs none."""
    f = path / "rollouts.jsonl"
    if not f.is_file():
        return None
    records, _ = read_records(path, max(f.stat().st_size - ROLLOUT_TAIL_BYTES, 0), "rollouts.jsonl")
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    if not steps:
        return None
    rows = [r for r in records if r.get("step") == steps[-1]][-ROLLOUT_ROWS:]
    columns = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "step"]
    return {"step": steps[-1], "columns": columns, "rows": [[r.get(k) for k in columns] for r in rows]}


def _config(path: Path) -> dict[str, Any]:
    """config.yaml's sections that are mappings (what a summary reads); {} when it is missing or unreadable."""
    try:
        data = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def summary(root: Path, path: Path) -> dict[str, Any]:
    """One row of the runs table: name, state, step of max_steps, last loss, tokens/s, checkpoints."""
    records = _last_records(path)
    steps = [r for r in records if "loss" in r]
    last = steps[-1] if steps else {}
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    cfg = _config(path)
    return {
        "name": str(path.relative_to(root.resolve())),
        "state": state(path),
        "step": last.get("step", 0),
        "max_steps": (cfg.get("train") or {}).get("max_steps"),
        "loss": last.get("loss"),
        "eval_loss": evals[-1] if evals else None,
        "tokens_per_s": last.get("tokens_per_s"),
        "checkpoints": [step for step, _ in list_checkpoints(checkpoints_root(path))],
        "model": (path / "model").is_dir(),
        "arch": (cfg.get("model") or {}).get("arch"),
        "method": (cfg.get("finetune") or {}).get("method", "full"),
        "profile": (path / "profile.json").is_file(),
    }


def list_runs(root: Path) -> list[dict[str, Any]]:
    return [summary(root, p) for p in find_runs(root)]


def detail(root: Path, name: str) -> dict[str, Any]:
    """A run's page: its summary, config YAML, lock holder or outcome, its `fitlm profile` report, `fitlm eval`
    scores and last logged GRPO completions, if any."""
    path = run_dir(root, name)
    out = summary(root, path)
    status, info = lock_status(path)
    out["lock"] = {"status": status, **info}
    config = path / "config.yaml"
    out["config_yaml"] = config.read_text(encoding="utf-8") if config.is_file() else None
    out["config_path"] = str(config) if config.is_file() else None
    out["path"] = str(path)
    out["profile_report"] = _profile(path)
    out["evaluation"] = evaluation(path)
    out["rollouts"] = rollouts(path)
    return out


def evaluation(path: Path) -> dict[str, Any] | None:
    """eval.json (what `fitlm eval` writes beside a run: lm-eval's results dict) as rows of task, metric, value and
    standard error; None when the run was never evaluated."""
    f = path / "eval.json"
    if not f.is_file():
        return None
    try:
        results = json.loads(f.read_text(encoding="utf-8")).get("results")
    except (OSError, ValueError, AttributeError):
        results = None
    if not isinstance(results, dict):
        return {"error": f"{f} is not lm-eval's results (interrupted while writing?); run `fitlm eval` again"}
    return {"rows": score_rows(results)}


def _profile(path: Path) -> dict[str, Any] | None:
    """profile.json's measured-vs-planned figures, report.md and the plot files beside them."""
    pj = path / "profile.json"
    if not pj.is_file():
        return None
    try:
        p = json.loads(pj.read_text(encoding="utf-8"), parse_constant=lambda _: None)
    except (OSError, ValueError):
        p = None
    if not isinstance(p, dict) or not isinstance(p.get("plan", {}), dict):
        return {"error": f"{pj} is not a fitlm profile (interrupted while writing?); run `fitlm profile` again"}
    plan = p.get("plan") or {}
    timing = plan.get("timing") or {}
    analytic = (plan.get("analytic") or {}).get("per_device") or {}
    measured = p.get("per_device") or {}
    rows = [
        {"what": k, "measured": measured.get(k), "planned": analytic.get(k)}
        for k in dict.fromkeys([*analytic, *measured])
        if isinstance(analytic.get(k, 0), (int, float)) and isinstance(measured.get(k, 0), (int, float))
    ]
    report = path / "report.md"
    return {
        "memory": rows,
        "timing": [
            {"what": "step time (s)", "measured": p.get("step_time_s"), "planned": timing.get("step_time_s")},
            {"what": "tokens/s", "measured": p.get("tokens_per_s"), "planned": timing.get("tokens_per_s")},
            {"what": "MFU", "measured": p.get("mfu"), "planned": timing.get("mfu")},
        ],
        "report_md": report.read_text(encoding="utf-8") if report.is_file() else None,
        "plots": sorted(f.name for f in path.glob("*.png")),
    }


__all__ = [
    "RunNotFound",
    "detail",
    "evaluation",
    "find_runs",
    "is_model_dir",
    "list_runs",
    "read_records",
    "run_dir",
    "state",
]
