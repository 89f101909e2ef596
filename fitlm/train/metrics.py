"""The metrics writer: metrics.jsonl records, the run trackers beside them (fitlm/train/trackers.py), warnings in
all."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

from fitlm.train.trackers import Tracker


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

    The same numbers go to each tracker (tags as in `scalars`); guard and warning records (those with a
    `message` or `reason`) become text entries. A tracker that raises is dropped with a warning (stderr and a
    metrics.jsonl record): the run goes on with metrics.jsonl and the other trackers.
    """

    def __init__(self, path: Path, trackers: list[Tracker] | None = None):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")
        self.trackers = list(trackers or [])

    def _line(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def write(self, record: dict[str, Any]) -> None:
        self._line(record)
        if "step" not in record:
            return
        step = int(record["step"])
        text = record.get("message") or record.get("reason")
        for tracker in list(self.trackers):
            try:
                if text:
                    kind = record.get("guard") or record.get("warning") or "event"
                    tracker.text(step, f"events/{kind}", f"{text} (action: {record.get('action', 'warn')})")
                else:
                    tracker.scalars(step, scalars(record))
            except Exception as e:  # a tracker never stops training
                self._drop(tracker, step, e)

    def _drop(self, tracker: Tracker, step: int, error: Exception) -> None:
        self.trackers.remove(tracker)
        message = (
            f"the {tracker.name} tracker failed ({type(error).__name__}: {error}); it gets no more metrics "
            "in this run, metrics.jsonl and the other trackers go on"
        )
        self._line({"step": step, "warning": "tracker_failed", "tracker": tracker.name, "message": message})
        print(f"fitlm: warning: step {step}: {message}", file=sys.stderr)

    def close(self) -> None:
        self._f.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # the run is done; say so, but do not fail it
                print(f"fitlm: warning: the {tracker.name} tracker did not close cleanly: {e}", file=sys.stderr)


def report(record: dict[str, Any], log) -> None:
    """An intervention or warning: one metrics.jsonl record and one stderr line (main rank only: `log` is None
    elsewhere)."""
    if log is None:
        return
    log.write(record)
    if "guard" in record:
        text = f"guard: step {record['step']}: {record['reason']}; action: {record['action']} (see {record['see']})"
    else:
        text = f"warning: step {record['step']}: {record['message']}"
    print(f"fitlm: {text}", file=sys.stderr)
