"""lm-eval's results dict read back: `results[task]["acc,none"]` (metric, then filter) and its
`"acc_stderr,none"` beside it, as one row per score. What `train.observe.eval_tasks` logs and `fitlm ui` shows
from eval.json; imports no lm-eval (a run's page reads the JSON without it)."""

from __future__ import annotations

from typing import Any


def score_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """[{"task", "metric", "value", "stderr"}] of every numeric score; `metric` is lm-eval's name, with the filter
    in brackets when it is not `none` (e.g. `exact_match[strict-match]`); stderr None where lm-eval gives none."""
    rows = []
    for task, metrics in results.items():
        for key, value in (metrics or {}).items():
            metric, _, filt = key.partition(",")
            if filt and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                err = metrics.get(f"{metric}_stderr,{filt}")
                name = metric if filt == "none" else f"{metric}[{filt}]"
                rows.append({"task": task, "metric": name, "value": value, "stderr": err})
    return rows


__all__ = ["score_rows"]
