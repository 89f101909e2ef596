"""Step time per parallel layout on this machine (CPU, gloo) for one small model and a fixed global batch.

Not a test: it prints a table and writes JSON. Every layout trains the same global batch of
`--global-batch` sequences, so the numbers compare the cost of the layouts themselves.

    python bench/layouts.py [--steps 12] [--json] [--out bench/results/layouts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PLAYS  # noqa: E402

SEQ = 256  # sequence length of every layout

# name, parallel block, processes
LAYOUTS = [
    ("single", {}, 1),
    ("dp2 zero0 (DDP)", {"data_parallel": 2}, 2),
    ("dp2 zero1", {"data_parallel": 2, "zero_stage": 1}, 2),
    ("dp2 zero2", {"data_parallel": 2, "zero_stage": 2}, 2),
    ("dp2 zero3", {"data_parallel": 2, "zero_stage": 3}, 2),
    ("tp2", {"tensor_parallel": 2}, 2),
    ("tp2 + sp", {"tensor_parallel": 2, "sequence_parallel": True}, 2),
    ("pp2 1f1b m4", {"pipeline_parallel": 2, "micro_batch_num": 4}, 2),
]


def fitlm(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fitlm.cli", *map(str, args)], capture_output=True, text=True)


def prepare_data(root: Path) -> None:
    for args in (
        ("data", "tokenizer", PLAYS / "macbeth_gut.txt", "--vocab-size", "1024", "--out", root / "tok.json"),
        ("data", "pack", PLAYS / "macbeth_gut.txt", "--tokenizer", root / "tok.json", "--out", root / "train"),
    ):
        proc = fitlm(*args, "--json")
        if proc.returncode:
            sys.exit(proc.stderr)


def run_layout(root: Path, name: str, parallel: dict, nproc: int, steps: int, global_batch: int) -> dict:
    dp = parallel.get("data_parallel", 1)
    cfg = {
        "model": {
            "hidden_size": 256,
            "num_layers": 4,
            "num_heads": 8,
            "num_kv_heads": 4,
            "intermediate_size": 512,
            "vocab_size": 1024,
            "max_seq_len": SEQ,
            "tie_embeddings": False,
        },
        "data": {"train": str(root / "train"), "seq_length": SEQ},
        "parallel": parallel,
        "train": {
            "micro_batch_size": global_batch // dp,
            "max_steps": steps,
            "log_interval": 1,
            "eval_interval": 0,
            "warmup_steps": 2,
            "output_dir": str(root / name.replace(" ", "_")),
            "progress": False,
        },
    }
    path = root / f"{name.replace(' ', '_')}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    proc = fitlm("train", path, "--json")
    wall = time.perf_counter() - t0
    if proc.returncode:
        return {"layout": name, "error": proc.stderr.strip().splitlines()[-1][:200]}
    records = [json.loads(x) for x in (Path(cfg["train"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][2:]  # skip warm-up steps
    return {
        "layout": name,
        "processes": nproc,
        "tokens_per_s": round(statistics.median(tps), 1),
        "step_time_s": round(global_batch * SEQ / statistics.median(tps), 4),
        "peak_bytes": max(r["peak_bytes"] for r in records if "peak_bytes" in r),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_data(root)
        results = [run_layout(root, n, p, k, args.steps, args.global_batch) for n, p, k in LAYOUTS]
    base = next(r["tokens_per_s"] for r in results if r["layout"] == "single")
    for r in results:
        if "tokens_per_s" in r:
            r["vs_single"] = round(r["tokens_per_s"] / base, 3)
    report = {"benchmark": "layouts", "global_batch": args.global_batch, "seq_length": SEQ, "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
        return
    print("| layout | processes | tokens/s | step time (s) | vs single | peak RSS (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['layout']} | - | error: {r['error']} | | | |")
        else:
            print(
                f"| {r['layout']} | {r['processes']} | {r['tokens_per_s']:,.0f} | {r['step_time_s']} | "
                f"{r['vs_single']} | {r['peak_bytes'] / 2**20:,.0f} |"
            )


if __name__ == "__main__":
    main()
