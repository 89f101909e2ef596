"""Step time vs data-parallel and tensor-parallel degree on CPU/gloo for a fixed global batch (issue #11).

Not a test: it prints a table (or one JSON object) and writes JSON. It reuses bench/layouts.py (same
model, data and `fitlm train` runs, which spawn torchrun --nproc-per-node N with gloo) for the degrees
1, 2, ... `--max-degree` of data parallel (DDP) and tensor parallel, and makes the communication cost
visible: every layout computes the same global batch of `--global-batch` sequences on the same cores, so
`overhead_s` = step time - single-process step time is what the layout adds (gloo collectives, smaller
per-rank matmuls); `overhead_share` = overhead_s / step time. `scaling_efficiency` = single / layout
tokens/s (1.0 = free; on a machine with more cores than one process uses, dp > 1 can exceed 1).

    python bench/scaling.py [--steps 12] [--max-degree 2] [--global-batch 8] [--json]
                            [--out bench/results/scaling.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per layout (the first 2 are not counted)")
    ap.add_argument("--max-degree", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        layouts.prepare_data(root)
        for name, parallel, nproc, kind, degree in degrees(args.max_degree):
            r = layouts.run_layout(root, name, parallel, nproc, args.steps, args.global_batch)
            rows.append({**r, "kind": kind, "degree": degree})
            print(f"measured {name}", file=sys.stderr, flush=True)
    base = rows[0]
    for r in rows:
        if "step_time_s" in r and "step_time_s" in base:
            r["overhead_s"] = round(r["step_time_s"] - base["step_time_s"], 4)
            r["overhead_share"] = round(r["overhead_s"] / r["step_time_s"], 3)
            r["scaling_efficiency"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    report = {"benchmark": "scaling", "machine": machine(), "global_batch": args.global_batch, "seq_length": 256,
              "steps": args.steps, "results": rows}
    write_json(args.out, report)
    if args.json:
        print(json.dumps(report))
        return
    print("| layout | processes | tokens/s | step s | overhead s | overhead share | efficiency |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['layout']} | {r.get('degree')} | error: {r['error']} | | | | |")
            continue
        print(f"| {r['layout']} | {r['processes']} | {r['tokens_per_s']:,.0f} | {r['step_time_s']:.3f} | "
              f"{r.get('overhead_s', 0):+.3f} | {r.get('overhead_share', 0):.0%} | {r.get('scaling_efficiency', 1):.2f} |")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
