"""Checks that run before any model, process group or file is made, so a bad run fails in a second.

Each check returns problems as strings naming the key and the fix; the trainer raises them all at once.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from fitlm import rules
from fitlm.atomic import atomic_file, recover_stale
from fitlm.checkpoint.compat import resume_conflicts
from fitlm.checkpoint.store import checkpoints_root, list_checkpoints
from fitlm.config import Config, ConfigError, upgrade_moved_keys
from fitlm.parallel.layout import layout_problems
from fitlm.train.run_lock import LOCK_FILE

RUN_CONFIG = "config.yaml"  # the resolved config a run writes into its output_dir first


def unsupported_options(cfg: Config) -> list[str]:
    """Options the schema accepts (they are part of the config contract) but this build or this machine
    cannot run: fitlm.rules' rows checked before a run starts."""
    return rules.violations(rules.flatten(cfg.model_dump()), stage="launch")


def launch_problems(cfg: Config, world_size: int) -> list[str]:
    """What a resolved config cannot run as for `world_size` processes on this build: fitlm.rules' launch stage
    and the world size against the declared layout (the model-dependent checks are fitlm.run_config's)."""
    return unsupported_options(cfg) + layout_problems(cfg, world_size)


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    fa, fb = rules.flatten(a), rules.flatten(b)
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def output_dir_problem(cfg: Config, overwrite: bool = False) -> str | None:
    """Why train.output_dir cannot take this run, or None. Two runs never share a directory; a run with
    `checkpoint.resume` other than `never` continues its own unfinished run there (fitlm.checkpoint.compat
    says which config changes keep it the same run)."""
    out = Path(cfg.train.output_dir)
    key = "train.output_dir"
    mode = cfg.checkpoint.resume
    if mode not in ("auto", "never") and not Path(mode).is_dir():
        return (
            f"checkpoint.resume: {mode!r} is neither `auto`, `never` nor an existing checkpoint directory; "
            "pass a checkpoints/step_N directory (or a run directory holding checkpoints/)"
        )
    if out.exists() and not out.is_dir():
        return f"{key}: {out} is a file; point it at a directory"
    if not (out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir())):  # only a lock: a fresh start
        return None
    previous = out / RUN_CONFIG
    if not previous.is_file():  # not ours: even --overwrite must not delete it
        return (
            f"{key}: {out} is not empty and holds no fitlm run ({RUN_CONFIG} missing); "
            "choose a new or empty directory, so nothing there is overwritten"
        )
    if overwrite:
        return None
    saved = upgrade_moved_keys(yaml.safe_load(previous.read_text()) or {})  # a run of an older fitlm
    if cfg.checkpoint.resume != "never":
        # checkpoint.resume: continue an unfinished run (or extend a finished one with more max_steps).
        conflicts = resume_conflicts(saved, cfg.to_dict())
        if conflicts:
            return (
                f"{key}: {out} holds a run that checkpoint.resume={cfg.checkpoint.resume} cannot continue: its config "
                f"differs in {'; '.join(conflicts)}. Only optimizer, schedule, logging, memory, checkpoint and "
                "layout keys may change on resume; use that run's values, choose another train.output_dir, or "
                "pass --overwrite to delete that run and start again"
            )
        done = list_checkpoints(checkpoints_root(out))
        if not (out / "model").is_dir() or (done and done[-1][0] < cfg.train.max_steps):
            return None
    diffs = config_differences(saved, cfg.to_dict())
    if diffs:
        return (
            f"{key}: {out} holds a different run; its config differs in {'; '.join(diffs)}. "
            "Choose another train.output_dir, or pass --overwrite to delete that run and start again"
        )
    return (
        f"{key}: {out} already holds a run of this config; choose another train.output_dir, "
        "or pass --overwrite to delete it and start again"
    )


def prepare_output_dir(cfg: Config, overwrite: bool = False) -> Path:
    """Create train.output_dir for this run (clearing it only under --overwrite) and write the resolved config."""
    problem = output_dir_problem(cfg, overwrite)
    if problem:
        raise ConfigError([problem])
    out = Path(cfg.train.output_dir)
    if overwrite and (out / RUN_CONFIG).is_file():
        for p in out.iterdir():  # all but the run lock, which this run holds (fitlm.train.run_lock)
            if p.name != LOCK_FILE:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for stale in recover_stale(out):  # a model/ or adapter/ save cut short by a crash or a power loss
        print(f"fitlm: removed {stale}, left by a save that did not finish", file=sys.stderr)
    with atomic_file(out / RUN_CONFIG) as tmp:
        tmp.write_text(cfg.to_yaml())
    return out
