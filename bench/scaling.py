"""Step time vs data-parallel and tensor-parallel degree on CPU/gloo for a fixed global batch (issue #11).

Not a test: it prints a table (or one JSON object) and writes JSON. It reuses bench/layouts.py (same
model, data and `fitlm train` runs, which spawn torchrun --nproc-per-node N with gloo) for the degrees
1, 2, ... `--max-degree` of data parallel (DDP) and tensor parallel, and makes the communication cost
visible: every layout computes the same global batch of `--global-batch` sequences on the same cores, so
`overhead_s` = step time - single-process step time is what the layout adds (gloo collectives, smaller
per-rank matmuls); `overhead_share` = overhead_s / step time.
`scaling_efficiency` = layout tokens/s / single-process tokens/s (1.0 = free; on a machine with more
cores than one process uses, dp > 1 can exceed 1).

    python bench/scaling.py [--steps 12] [--max-degree 2] [--global-batch 8] [--repeats 2] [--json]
                            [--out bench/results/scaling.json]
    python bench/scaling.py --markdown [bench/results/scaling.json]   # the RESULTS.md table of a saved run

Each layout runs `--repeats` times, in rounds over all layouts, and its fastest run is kept (all runs'
tokens/s are in `tokens_per_s_runs`): on a shared machine a burst of another job then costs one run,
not the comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layouts  # noqa: E402
from common import RESULTS, machine, write_json  # noqa: E402


def degrees(max_degree: int) -> list[tuple[str, dict, int, str, int]]:
    """(layout name, parallel section, processes, kind, degree), single process first."""
    out = [("single", {}, 1, "none", 1)]
    d = 2
    while d <= max_degree:
        out.append((f"dp{d} (DDP)", {"data_parallel": d}, d, "dp", d))
        out.append((f"tp{d}", {"tensor_parallel": d}, d, "tp", d))
        d *= 2
    return out


def summarize(report: dict) -> dict:
    """Add overhead_s, overhead_share and scaling_efficiency to every measured layout (vs the single process)."""
    rows = report["results"]
    base = rows[0]
    for r in rows:
        if "step_time_s" in r and "step_time_s" in base:
            r["overhead_s"] = round(r["step_time_s"] - base["step_time_s"], 4)
            r["overhead_share"] = round(r["overhead_s"] / r["step_time_s"], 3)
            r["scaling_efficiency"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    return report


def table(report: dict) -> str:
    """The bench/RESULTS.md table of one run (also what --markdown prints from a saved JSON)."""
    m = report["machine"]
    lines = [
        f"- Machine: {m.get('cpus')} CPUs, load average at the end {m.get('load_avg_1m', '?')}; "
        f"Python {m.get('python')}, torch {m.get('torch')}",
        f"- Command: `{report.get('command', 'python bench/scaling.py')}`",
        f"- Global batch {report['global_batch']} × sequence {report['seq_length']}, {report['steps']} steps per "
        "layout (median of the steps after the first 2), fastest of "
        f"{report.get('repeats', 1)} runs per layout",
        "",
        "| layout | kind | degree | processes | tokens/s | step s | overhead s | overhead share | efficiency |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['kind']} | {r['degree']} | - | error: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['layout']} | {r['kind']} | {r['degree']} | {r['processes']} | {r['tokens_per_s']:,.0f} | "
            f"{r['step_time_s']:.3f} | {r.get('overhead_s', 0):+.3f} | {r.get('overhead_share', 0):.0%} | "
            f"{r.get('scaling_efficiency', 1):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per layout (the first 2 are not counted)")
    ap.add_argument("--max-degree", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="rounds over all layouts; the fastest run of each is kept")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    ap.add_argument(
        "--markdown",
        nargs="?",
        type=Path,
        const=RESULTS / "scaling.json",
        metavar="JSON",
        help="print the bench/RESULTS.md table of a saved run (default: the results file) and exit",
    )
    args = ap.parse_args()
    if args.markdown:
        print(table(json.loads(args.markdown.read_text())))
        return
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        layouts.prepare_data(root)
        for rep in range(args.repeats):  # rounds over all layouts: a burst of another job hits one run, not a layout
            for name, parallel, nproc, kind, degree in degrees(args.max_degree):
                r = layouts.run_layout(root, name, parallel, nproc, args.steps, args.global_batch)
                runs.setdefault(name, []).append({**r, "kind": kind, "degree": degree})
                print(f"measured {name} (round {rep + 1})", file=sys.stderr, flush=True)
    rows = []
    for rs in runs.values():
        ok = [r for r in rs if "tokens_per_s" in r]
        best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else rs[0]
        rows.append({**best, "tokens_per_s_runs": [r.get("tokens_per_s") for r in rs]})
    report = summarize(
        {
            "benchmark": "scaling",
            "machine": machine(),
            "global_batch": args.global_batch,
            "seq_length": layouts.SEQ,
            "steps": args.steps,
            "repeats": args.repeats,
            "wall_s": round(time.perf_counter() - t0, 1),
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "results": rows,
        }
    )
    write_json(args.out, report)
    if args.json:
        print(json.dumps(report))
        return
    print(table(report))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
