"""Where a run resumes from, and whether it may: the checkpoint source, its compatibility, the metrics to keep."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fitlm.checkpoint import store
from fitlm.checkpoint.compat import resume_conflicts
from fitlm.checkpoint.errors import CheckpointError


def resume_source(cfg) -> Path | None:
    """The checkpoint a run starts from: the output dir's own latest, else `checkpoint.resume` if it is a path."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    own = store.latest_checkpoint(cfg.train.output_dir)
    if own is not None or mode == "auto":
        return own
    path = Path(mode)
    if (path / store.CKPT_DIR).is_dir():  # a run directory: its latest checkpoint
        latest = store.latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(
                f"checkpoint.resume: {path} is a run directory without checkpoints; pass a "
                "checkpoint directory (checkpoints/step_N) or set checkpoint.resume: auto"
            )
        return latest
    return path


def check_resumable(ckpt: Path, cfg, tokenizer_sha256: str) -> dict[str, Any]:
    """Metadata of `ckpt` after refusing what this run cannot resume: damage, another run, another tokenizer."""
    meta = store.read_meta(ckpt)
    conflicts = resume_conflicts(meta.get("config", {}), cfg.to_dict())
    if conflicts:
        raise CheckpointError(
            f"checkpoint {ckpt} belongs to a different run; the config differs in "
            f"{'; '.join(conflicts)}. Resume with the config it was saved with "
            f"({ckpt / store.META_FILE} holds it), or start a fresh run in another train.output_dir"
        )
    if meta.get("tokenizer_sha256") != tokenizer_sha256:
        raise CheckpointError(
            f"checkpoint {ckpt} was trained with another tokenizer (sha256 "
            f"{str(meta.get('tokenizer_sha256'))[:12]}, now {tokenizer_sha256[:12]}); token ids "
            f"would mean other text. Point data.tokenizer at the one it used (a copy is "
            f"{ckpt / 'tokenizer.json'}) or start a fresh run"
        )
    return meta


def say_starting_over(output_dir: str | Path) -> None:
    """A rerun into a directory whose run left metrics but no checkpoint starts over: say so, not silently."""
    metrics = Path(output_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        print(
            f"fitlm: {output_dir} holds no checkpoint of the run before: starting over from step 1 (its "
            "metrics.jsonl is cleared; checkpoint.interval saves as it goes, checkpoint.save_on_signal on a stop)",
            file=sys.stderr,
        )


def trim_metrics(path: Path, step: int) -> None:
    """Drop metrics.jsonl records past `step`: the resumed run logs those steps again."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines() if _step_of(line) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    tmp.replace(path)


def _step_of(line: str) -> float:
    """A metrics record's step; a torn line (the process was killed while writing it) is dropped (inf)."""
    try:
        record = json.loads(line)
    except ValueError:
        return float("inf")
    return record.get("step", 0) if isinstance(record, dict) else float("inf")
