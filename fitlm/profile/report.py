"""Every rank's measurements + the plan -> the profile's JSON (the blueprint's keys) and report.md.

As with `fitlm plan`, the markdown is rendered from exactly the dict that `--json` prints and
profile.json holds, so they never disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fitlm.config import Config
from fitlm.parallel_dims import layout_name
from fitlm.profile.compare import COMPONENTS, comparable, hold_against

MiB = 2**20
TOP = 10  # rows in the by-module and by-operator tables


def layout(cfg: Config) -> str:
    p = cfg.parallel
    parts = [
        layout_name(p.data_parallel, p.tensor_parallel, p.pipeline_parallel, p.context_parallel),
        f"zero{p.zero_stage}",
    ]
    if p.sequence_parallel:
        parts.append("sp")
    if p.pipeline_parallel > 1:
        parts.append(f"{p.pipeline_schedule}×{p.micro_batch_num}")
    m = cfg.memory
    parts += [m.mixed_precision, f"recompute={m.recompute}"]
    return " ".join(parts)


def assemble(cfg: Config, config_path: str, steps: int, ranks: list[dict], plan: dict[str, Any]) -> dict[str, Any]:
    """The profile's one JSON object. Top level: the most loaded rank's measured `per_device` components,
    `tokens_per_s` and `mfu` of the slowest rank, `peak_bytes` = the largest peak over ranks."""
    measured = [r for r in ranks if r["memory"]]
    loaded = max(measured, key=lambda r: r["memory"]["total"]) if measured else None
    slowest = max(ranks, key=lambda r: r["step_s"])
    device_peaks = [
        r["cuda_peak_bytes"] if r["cuda_peak_bytes"] is not None else (r["memory"] or {}).get("total", 0) for r in ranks
    ]
    m = cfg.model
    out: dict[str, Any] = {
        "config": str(config_path),
        "model": {"arch": m.arch, "hidden_size": m.hidden_size, "layers": m.num_layers, "vocab_size": m.vocab_size},
        "layout": layout(cfg),
        "world_size": len(ranks),
        "device": ranks[0]["device"],
        "steps": steps,
        "tokens_per_step": ranks[0]["tokens_per_step"],
        "per_device": loaded["memory"] if loaded else None,
        "most_loaded_rank": loaded["rank"] if loaded else None,
        "tokens_per_s": slowest["tokens_per_s"],
        "mfu": slowest["mfu"],
        "step_time_s": slowest["step_s"],
        "peak_bytes": max(device_peaks),
        # an MoE model's largest max / mean tokens per expert over the burst's steps (`fitlm plan --expert-load`)
        "expert_load": max((r["expert_load"] for r in ranks if r.get("expert_load") is not None), default=None),
        "peak_kind": "cuda allocator peak" if ranks[0]["cuda_peak_bytes"] is not None else "peak live tensor bytes",
        "rss_peak_bytes": max(r["rss_peak_bytes"] for r in ranks),
        "step_seconds": slowest["phase_s"],
        "comm_s": slowest["comm"]["comm_s"],
        "comm_share": max(r["comm"]["comm_share"] for r in ranks),
        "plan": plan,
        "errors": hold_against(loaded["memory"] if loaded else None, plan),
        "history": [
            {"step": s["step"], "loss": s["loss"], "tokens_per_s": s["tokens_per_s"]} for s in ranks[0]["steps"]
        ],
        "per_rank": ranks,
    }
    errors = [r["memory_error"] for r in ranks if r["memory_error"]]
    if errors:
        out["memory_error"] = errors[0]
    return out


def write_json(result: dict[str, Any], out: Path) -> Path:
    path = out / "profile.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / MiB:,.2f}"


def _pct(e: float | None) -> str:
    return "–" if e is None else f"{e:+.1%}"


def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    align = ["---"] * right_from + ["---:"] * (len(header) - right_from)
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def markdown(r: dict[str, Any], plots: list[str]) -> str:
    plan, timing = r["plan"], r["plan"]["timing"]
    lines = [
        f"# fitlm profile: {r['config']}",
        "",
        f"{r['model']['arch']} h{r['model']['hidden_size']} × {r['model']['layers']} layers, vocab "
        f"{r['model']['vocab_size']} · {r['layout']} · {r['world_size']} process(es) on {r['device']} · "
        f"{r['steps']} timed steps (the first is warm-up and left out of the averages)",
        "",
        "## Summary",
        "",
    ]
    lines += _table(
        ["", "measured", "planned"],
        [
            ["step time (s)", f"{r['step_time_s']:.4f}", f"{timing['step_time_s']:.4f}"],
            ["tokens/s", f"{r['tokens_per_s']:,.0f}", f"{timing['tokens_per_s']:,.0f}"],
            ["MFU", f"{r['mfu']:.2%}", f"{timing['mfu']:.2%}"],
            [
                f"peak ({r['peak_kind']}, MiB, largest rank)",
                _mib(r["peak_bytes"]),
                _mib(plan["analytic"]["per_device"]["total"]),
            ],
            ["process RSS peak (MiB, largest rank)", _mib(r["rss_peak_bytes"]), "–"],
            ["communication share of a step", f"{r['comm_share']:.1%}", "–"],
        ],
    )
    lines += _per_rank(r) + _memory(r) + _step_time(r) + _where_memory_goes(r)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _per_rank(r: dict[str, Any]) -> list[str]:
    """Each rank's step time, speed, peaks and communication share."""
    lines: list[str] = []
    lines += ["", "## Per rank", ""]
    lines += _table(
        ["rank", "dp/tp/pp", "step s", "tokens/s", "MFU", "peak live MiB", "RSS peak MiB", "comm share"],
        [
            [
                str(x["rank"]),
                f"{x['dp_rank']}/{x['tp_rank']}/{x['pp_rank']}",
                f"{x['step_s']:.4f}",
                f"{x['tokens_per_s']:,.0f}",
                f"{x['mfu']:.2%}",
                _mib((x["memory"] or {}).get("total")),
                _mib(x["rss_peak_bytes"]),
                f"{x['comm']['comm_share']:.1%}",
            ]
            for x in r["per_rank"]
        ],
        right_from=2,
    )
    return lines


def _memory(r: dict[str, Any]) -> list[str]:
    """The most loaded rank's measured components beside both planner engines."""
    lines: list[str] = []
    plan = r["plan"]
    lines += ["", f"## Memory: measured vs planned (rank {r['most_loaded_rank']}, the most loaded)", ""]
    if r["per_device"] is None:
        lines.append(f"Not measured: {r.get('memory_error')}")
    else:
        sim = plan.get("simulated", {}).get("per_device")
        analytic, simulated = comparable(plan["analytic"]["per_device"]), comparable(sim) if sim else None
        err = r["errors"]
        rows = []
        for k in COMPONENTS:
            row = [k, _mib(r["per_device"][k]), _mib(analytic[k]), _pct(err["analytic"][k])]
            row += [_mib(simulated[k]), _pct(err["simulated"][k])] if simulated else ["–", "–"]
            rows.append(row)
        lines += _table(["MiB", "measured", "analytic", "error", "simulated", "error"], rows)
        lines += [
            "",
            "Measured: peak live tensor bytes of one step (torch MemTracker); planned activations include "
            "the logits (a storage tracker cannot tell them apart). Error = planned / measured − 1.",
        ]
        if "error" in plan.get("simulated", {}):
            lines += ["", f"Simulation: {plan['simulated']['error']}"]
    return lines


def _step_time(r: dict[str, Any]) -> list[str]:
    """The slowest rank's phases and its communication."""
    lines: list[str] = []
    lines += ["", "## Step time (slowest rank)", ""]
    step = r["step_time_s"]
    # Communication is timed over the traced steps (slower under the profiler): its share is of those steps.
    traced = max(r["per_rank"], key=lambda x: x["step_s"])["comm"]
    lines += _table(
        ["phase", "seconds", "share"],
        [[k, f"{v:.4f}", f"{v / step:.1%}"] for k, v in r["step_seconds"].items()]
        + [["communication (inside the phases above)", f"{r['comm_s']:.4f}", f"{traced['comm_share']:.1%}"]],
    )
    lines += [
        "",
        "Phases are wall times from the trainer's PhaseTimer (device-synchronised on CUDA); `other` is host "
        "work between them. Communication is the time torch.profiler saw in collectives "
        "(`gloo:*`/`nccl:*`/c10d ops) over two traced steps; it overlaps forward/backward/optimizer.",
    ]
    return lines


def _where_memory_goes(r: dict[str, Any]) -> list[str]:
    """Rank 0's top modules by bytes kept after forward, and top allocating operators."""
    lines: list[str] = []
    rank0 = r["per_rank"][0]
    modules = sorted((m for m in rank0["modules"] if "." in m["module"]), key=lambda m: -m["forward_kept"])[:TOP]
    if modules:
        lines += ["", "## Where the memory goes: top modules (rank 0)", ""]
        lines += _table(
            ["module", "params MiB", "kept after forward MiB", "forward peak rise MiB", "backward peak rise MiB"],
            [
                [
                    f"`{m['module']}`",
                    _mib(m["params"]),
                    _mib(m["forward_kept"]),
                    _mib(m["forward_peak"]),
                    _mib(m["backward_peak"]),
                ]
                for m in modules
            ],
        )
        lines += [
            "",
            "Kept after forward: bytes the module's forward left alive (saved activations and its output); "
            "a module includes its children.",
        ]
    ops = rank0["comm"]["ops"][:TOP]
    if ops:
        lines += ["", "## Where the memory goes: top operators (rank 0)", ""]
        lines += _table(
            ["operator", "MiB allocated per step", "calls per step"],
            [[f"`{o['op']}`", _mib(o["bytes"]), str(o["calls"])] for o in ops],
        )
        lines += [
            "",
            "torch.profiler (profile_memory): bytes each operator allocated, less what it freed within the "
            "same call, summed over its calls in one step. Outputs freed later by other ops still count, so "
            "this ranks the ops that allocate most, not what stays alive (the module table shows that).",
        ]
    return lines


def write_markdown(result: dict[str, Any], out: Path, plots: list[str]) -> Path:
    path = out / "report.md"
    path.write_text(markdown(result, plots))
    return path
