"""The guide's three scenarios planned by fitlm, beside what the guide says (the README's table).

    python bench/guide_scenarios.py          # markdown table
    python bench/guide_scenarios.py --json   # one JSON object: {"scenarios": [...]}

Planner only: nothing is trained or allocated. The configs are the shipped configs/guide-*.yaml; the
guide's figures are quoted as the guide gives them (it states no batch size for the third scenario: the
shipped config's assumption is in its comments).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9

# (name, config, device, devices, what the guide says). Units as the guide gives them: GB, s/step, tokens/s.
SCENARIOS = [
    ("7B LoRA on 1 × 24 GB", "configs/guide-7b-lora-24gb.yaml", "rtx4090", 1, {"fits": True}),
    ("7B on 4 × 24 GB", "configs/guide-7b-4x24gb.yaml", "rtx4090", 4, {"layout": "dp2×tp2×pp2"}),
    (
        "7B LoRA on 8 × 64 GB",
        "configs/guide-7b-lora-8x64gb.yaml",
        "ascend-910b",
        8,
        {"step_time_s": 1.8, "peak_gb": 52.0, "tokens_per_s": 14564.0},
    ),
]


def plan_scenario(config: str, device: str, n: int) -> dict:
    """fitlm's plan of one scenario; a layout refused for `n` devices is reported with its error, and the
    search's fastest fitting layout planned instead."""
    from fitlm.config import ConfigError, load_config
    from fitlm.plan.devices import get_device
    from fitlm.plan.report import plan

    cfg, dev = load_config(ROOT / config), get_device(device)
    out = {"config": config, "device": device, "num_devices": n}
    try:
        result = plan(cfg, dev, n)
    except ConfigError as e:
        out["refused"] = str(e)
        result = plan(cfg, dev, n, search=True, top=1)
        top = result["search"]["top"]
        out["search_best"] = top[0] if top else None
        return out
    out.update(
        layout=result["layout"],
        fits=result["fits"],
        peak_gb=result["per_device"]["total"] / GB,
        step_time_s=result["step_time_s"],
        tokens_per_s=result["tokens_per_s"],
        host_peak_gb=max(result["host"]["per_node"].values()) / GB,
    )
    return out


def rows() -> list[dict]:
    return [
        {"scenario": name, "guide": guide, "plan": plan_scenario(config, device, n)}
        for name, config, device, n, guide in SCENARIOS
    ]


def _planned(p: dict) -> str:
    if "refused" in p:
        best = p["search_best"]
        found = (
            (
                f"`--search`: {best['layout']} ({best['memory_options']}), {best['per_device_total'] / GB:.1f} GB "
                f"per device, {best['tokens_per_s']:,.0f} tokens/s"
            )
            if best
            else "`--search`: no layout fits"
        )
        arithmetic = p["refused"].splitlines()[-1].strip(" -").split(";")[0]  # "... = 8, but 4 processes run"
        return f"refused: {arithmetic}; {found}"
    verdict = "fits" if p["fits"] else "does not fit"
    return (
        f"{verdict}: {p['layout'].strip()}, {p['peak_gb']:.1f} GB per device, {p['step_time_s']:.2f} s/step, "
        f"{p['tokens_per_s']:,.0f} tokens/s; host {p['host_peak_gb']:.1f} GB per node"
    )


def _guide(g: dict) -> str:
    if "fits" in g:
        return "fits"
    if "layout" in g:
        return f"{g['layout']}"
    return f"{g['step_time_s']} s/step, {g['peak_gb']:g} GB peak, {g['tokens_per_s']:,.0f} tokens/s"


def markdown(table: list[dict]) -> str:
    lines = ["| scenario | config | guide | fitlm plan |", "| --- | --- | --- | --- |"]
    for r in table:
        p = r["plan"]
        lines.append(
            f"| {r['scenario']} | `{p['config']}` on {p['num_devices']}× {p['device']} | {_guide(r['guide'])} "
            f"| {_planned(p)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    table = rows()
    print(json.dumps({"scenarios": table}) if args.json else markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
