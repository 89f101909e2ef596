"""Routing imbalance in the plan: the most a rank's experts can receive under expert parallel, planned as a worst
case beside the balanced routing the engines assume (`fitlm plan`'s `routing`).

Why only under expert parallel: with every expert on the rank (one process, data, tensor or context parallel) a
forward runs all of its own N·k (token, expert) slots however the router spreads them, so dropless routing saves
the same rows and a capacity only drops some. Under expert parallel a rank runs the slots that the ep group's
ranks route to its E/ep experts: N·k of them when routing is balanced (as many as it sends), more when its experts
are the popular ones. `Setup.imbalance` is that ratio, received over N·k; it scales what the rank's experts read
and save (the gathered rows, the k experts' MLP activations: fitlm.plan.blocks) and the all-to-all's receive
buffer (fitlm.plan.expert_parallel). The router's tensors and the weighted outputs stay on the token's rank.

The worst case is the smallest of these bounds that applies:
- always (dropless): a token's k experts are distinct, so at most min(k, E/ep) of them are on one rank; a rank
  receives at most ep · N · min(k, E/ep) slots, every token of the ep group choosing this rank's experts:
  a factor ep · min(k, E/ep) / k. With nothing below, this is the worst case planned (the default): a dropless
  run can reach it (routing collapse), and only a capacity rules it out.
- model.capacity_factor cf: an expert keeps at most C = ceil(cf · N·k · ep / E) of the ep group's slots
  (fitlm.models.moe.capacity), so a rank at most E/ep · C: about cf.
- a measured expert load ℓ (`--expert-load`: max / mean slots per expert, as `fitlm profile` and training log
  it): each of the rank's experts takes at most ℓ times the mean, so the rank at most ℓ · N·k. A measurement,
  not a bound: the logged load is a whole step's (its micro batches and ranks summed), and one forward can be
  more skewed than its step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fitlm.plan.analytic import breakdown
from fitlm.plan.pipeline import shape
from fitlm.plan.setup import Setup


@dataclass(frozen=True)
class ExpertLoad:
    """A measured max / mean slots per expert (1 = balanced, E/k = every token on the same k) and where it is from."""

    factor: float
    source: str


class ExpertLoadError(ValueError):
    """An `--expert-load` that gives no expert load."""


def dropless_bound(s: Setup) -> float:
    """The most a rank's experts receive over the balanced N·k, with nothing dropped: ep · min(k, E/ep) / k."""
    k, e = s.cfg.model.num_experts_per_tok, s.cfg.model.num_experts or 1
    return s.ep * min(k, e // s.ep) / k


def capacity_bound(s: Setup, capacity_factor: float) -> float:
    """What E/ep experts of capacity C = ceil(cf · N·k · ep / E) each take, over N·k; N one forward's tokens."""
    k, e = s.cfg.model.num_experts_per_tok, s.cfg.model.num_experts or 1
    tokens = shape(s, True)[0]
    c = math.ceil(capacity_factor * tokens * k * s.ep / e)
    return e // s.ep * c / (tokens * k)


def worst_imbalance(s: Setup, load: ExpertLoad | None) -> tuple[float, str]:
    """(the worst-case `Setup.imbalance` for this layout, what sets it); 1 without expert parallel."""
    if s.ep == 1:
        return 1.0, "every expert runs on each rank (no expert parallel): routing moves no memory"
    bounds = []  # in the order a tie names them: what was measured, then the capacity, then the default
    if load is not None:
        bounds.append((load.factor, f"expert load {load.factor:.3g} from {load.source}"))
    cf = s.cfg.model.capacity_factor
    if cf is not None:
        bounds.append((capacity_bound(s, cf), f"model.capacity_factor {cf:g}"))
    local = (s.cfg.model.num_experts or 0) // s.ep
    bounds.append((dropless_bound(s), f"dropless, the default: every token's experts among one rank's {local}"))
    factor, why = min(bounds, key=lambda b: b[0])  # (the first of equal ones)
    return max(1.0, factor), why


def summary(s: Setup, balanced: Any, load: ExpertLoad | None) -> dict[str, Any]:
    """The plan's `routing`: the worst-case factor, what sets it, and the per-device bytes under balanced routing
    (`balanced`, the plan's breakdown) and under the worst case, side by side."""
    factor, why = worst_imbalance(s, load)
    worst = breakdown(replace(s, imbalance=factor)) if factor > 1 else balanced
    out: dict[str, Any] = {
        "imbalance": factor,
        "source": why,
        "balanced": balanced.as_dict(),
        "worst_case": worst.as_dict(),
        "extra_bytes": worst.total - balanced.total,
    }
    if load is not None:
        out["expert_load"] = {"factor": load.factor, "source": load.source}
    return out


def describe(r: dict[str, Any], usable: int) -> str:
    """One line for the text report: the worst case against the balanced total and the usable memory."""
    if r["imbalance"] == 1:
        return f"routing: {r['source']}"
    worst = r["worst_case"]["total"]
    verdict = "fits" if worst <= usable else "does not fit"
    simulated = r.get("simulated_worst_case", {}).get("total")  # (plan --simulate)
    if simulated is not None:
        verdict += f"; simulated {_size(simulated)}"
    return (
        f"routing: worst case {_size(worst)} per device ({verdict}), {_size(r['extra_bytes'])} over balanced "
        f"routing: a rank's experts receive {r['imbalance']:.3g}× their balanced rows ({r['source']})"
    )


def _size(n: float) -> str:
    """GiB as the report shows them, MiB below a tenth of one (a tiny model's worst case is visible too)."""
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 / 10 else f"{n / 1024**2:.2f} MiB"


def read_expert_load(value: str) -> ExpertLoad:
    """`--expert-load`: a number (max / mean slots per expert), a `fitlm profile` result (profile.json or its
    directory) or a training run's metrics.jsonl (or its output directory): the largest load it logged."""
    try:
        number: float | None = float(value)
    except ValueError:
        number = None
    if number is not None:
        return _checked(number, "--expert-load")
    path = Path(value)
    if path.is_dir():
        found = [p for p in (path / "profile.json", path / "metrics.jsonl") if p.is_file()]
        if not found:
            raise ExpertLoadError(
                f"--expert-load {path}: holds neither profile.json nor metrics.jsonl; give a `fitlm profile` "
                "--out directory, a training run's output directory, one of their files, or a number"
            )
        path = found[0]
    if not path.is_file():
        raise ExpertLoadError(
            f"--expert-load {value}: no such file and not a number; give a profile.json, a metrics.jsonl, "
            "their directory, or the max / mean slots per expert (e.g. 1.5)"
        )
    loads = _loads(path)
    if not loads:
        raise ExpertLoadError(
            f"--expert-load {path}: no `expert_load` in it (a dense model's run, or a profile written before "
            "fitlm recorded it); profile or train the MoE config again, or give the factor as a number"
        )
    return _checked(max(loads), str(path))


def _loads(path: Path) -> list[float]:
    """Every `expert_load` a profile.json (top level, or its ranks') or a metrics.jsonl (its records) holds."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            records = [data, *data.get("per_rank", [])] if isinstance(data, dict) else []
    except json.JSONDecodeError as exc:
        raise ExpertLoadError(
            f"--expert-load {path}: not JSON ({exc}); give fitlm's profile.json or metrics.jsonl"
        ) from None
    return [float(r["expert_load"]) for r in records if isinstance(r, dict) and r.get("expert_load") is not None]


def _checked(factor: float, source: str) -> ExpertLoad:
    if not math.isfinite(factor) or factor < 1:
        raise ExpertLoadError(
            f"--expert-load {source}: {factor:g} is not an expert load; it is max / mean slots per expert, "
            "at least 1 (1 = balanced)"
        )
    return ExpertLoad(factor, source)
