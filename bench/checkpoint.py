"""What checkpointing costs the training loop: no checkpoints vs. synchronous vs. async saves.

Not a test: it prints a table and writes JSON. One process trains a ~27M-parameter Llama (a ~320 MB
checkpoint with AdamW states) for `--steps` steps, saving every `--interval` steps. For every step the
time inside the training step and the time the loop was blocked by the checkpointer (save, or
publishing a finished async save) are measured separately; the overhead is the blocked time per step.

    python bench/checkpoint.py [--steps 12] [--interval 4] [--json] [--out bench/results/checkpoint.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PLAYS = ROOT / "examples" / "data" / "shakespeare"

MODES = [("none", {"interval": 0}), ("sync", {}), ("async", {"async_save": True})]


def prepare_data(root: Path) -> None:
    for args in (
        ("data", "tokenizer", PLAYS / "macbeth_gut.txt", "--vocab-size", "2048", "--out", root / "tok.json"),
        ("data", "pack", PLAYS / "macbeth_gut.txt", "--tokenizer", root / "tok.json", "--out", root / "train"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "fitlm.cli", *map(str, args), "--json"], capture_output=True, text=True
        )
        if proc.returncode:
            sys.exit(proc.stderr)


def run_mode(root: Path, name: str, ckpt: dict, steps: int, interval: int) -> dict:
    from fitlm.config import validate_dict
    from fitlm.train.trainer import Trainer

    out = root / name
    cfg = {
        "model": {
            "hidden_size": 512,
            "num_layers": 8,
            "num_heads": 8,
            "num_kv_heads": 4,
            "intermediate_size": 1376,
            "vocab_size": 2048,
            "max_seq_len": 128,
            "tie_embeddings": False,
        },
        "data": {"train": str(root / "train"), "seq_length": 128},
        "train": {
            "micro_batch_size": 4,
            "max_steps": steps,
            "log_interval": steps,
            "eval_interval": 0,
            "warmup_steps": 2,
            "output_dir": str(out),
            "progress": False,
            "peak_tflops": 1.0,
        },
        "checkpoint": {"interval": interval, "keep_last": 2, **ckpt},
    }
    trainer = Trainer(validate_dict(cfg))
    ck = trainer.checkpointer
    marks: list[tuple[float, float]] = []  # (enter, leave) of after_step, per step
    original = ck.after_step

    def timed(step, *a):
        t0 = time.perf_counter()
        original(step, *a)
        marks.append((t0, time.perf_counter()))

    ck.after_step = timed
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    train_s = [marks[i][0] - (marks[i - 1][1] if i else t0) for i in range(len(marks))][1:]  # step 1 warms up
    blocked = [b - a for a, b in marks]
    size = (
        sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file())
        if (out / "checkpoints").exists()
        else 0
    )
    saves = len(ck.save_seconds)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "mode": name,
        "steps": steps,
        "saves": saves,
        "train_step_s": round(statistics.median(train_s), 4),
        "blocked_per_save_s": round(sum(blocked) / max(1, saves), 4),
        "overhead_per_step_s": round(sum(blocked) / steps, 4),
        "checkpoint_bytes": size // max(1, min(saves, 2)),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_data(root)
        results = [run_mode(root, n, c, args.steps, args.interval) for n, c in MODES]
    base = results[0]["train_step_s"]
    for r in results:
        r["overhead_vs_step"] = round(r["overhead_per_step_s"] / base, 4)
    report = {
        "benchmark": "checkpoint",
        "interval": args.interval,
        "params": "27M",
        "device": "cpu",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
        return
    print(f"checkpoint every {args.interval} steps; overhead = loop time blocked by checkpointing / steps")
    print(
        "| mode | saves | train step (s) | blocked per save (s) | overhead per step (s) | vs step | checkpoint (MiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['mode']} | {r['saves']} | {r['train_step_s']} | {r['blocked_per_save_s']} | "
            f"{r['overhead_per_step_s']} | {r['overhead_vs_step']:.1%} | {r['checkpoint_bytes'] / 2**20:,.0f} |"
        )


if __name__ == "__main__":
    main()
