"""The metrics writer: metrics.jsonl records, TensorBoard scalars beside them, and warnings in both."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

from fitlm.rules import tensorboard_installed


def tensorboard_dir(output_dir: Path, setting: str | bool) -> Path | None:
    """Where TensorBoard event files go for this `train.observe.tensorboard` setting, or None for no TensorBoard."""
    on = setting is True or (setting == "auto" and tensorboard_installed())  # true without it: fitlm.rules refuses
    return Path(output_dir) / "tensorboard" if on else None


def scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) of every number in a record; nested dicts become `a/b`, lists `a/0`, `a/1`, ..."""
    for key, value in record.items():
        if key == "step" or isinstance(value, (bool, str)) or value is None:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, tag + "/")
        elif isinstance(value, list):
            yield from scalars({str(i): v for i, v in enumerate(value)}, tag + "/")
        elif isinstance(value, (int, float)):
            yield tag, float(value)


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl; flushed each write so a crash keeps the history.

    With `tensorboard_dir` the same numbers also go to TensorBoard event files there (tags as in
    `scalars`); guard and warning records (those with a `message` or `reason`) become text entries.
    """

    def __init__(self, path: Path, tensorboard_dir: Path | None = None):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in record:
            self._write_tensorboard(record)

    def _write_tensorboard(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        text = record.get("message") or record.get("reason")
        if text:
            kind = record.get("guard") or record.get("warning") or "event"
            self._tb.add_text(f"events/{kind}", f"{text} (action: {record.get('action', 'warn')})", step)
            return
        for tag, value in scalars(record):
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def report(record: dict[str, Any], log) -> None:
    """An intervention or warning: one metrics.jsonl record and one stderr line (main rank only: `log` is None elsewhere)."""
    if log is None:
        return
    log.write(record)
    if "guard" in record:
        text = f"guard: step {record['step']}: {record['reason']}; action: {record['action']} (see {record['see']})"
    else:
        text = f"warning: step {record['step']}: {record['message']}"
    print(f"fitlm: {text}", file=sys.stderr)
