"""Long context on this machine (issue #21): a sequence length whose training step does not fit one process
under a stated memory budget, and runs under context parallel (cp2), in plan and in measurement.

Not a test: it prints a table and writes JSON.

    python bench/long_context.py [--seq 4096] [--budget-mib 320] [--document-mask] [--steps 2] [--out FILE.json]

Each row is `fitlm profile` of the same config (the real trainer on gloo processes, one thread each) at one layout:
the measured peak of live tensor bytes per process (torch's MemTracker over one step: parameters, gradients,
optimizer states, activations, the gathered keys and values), tokens/s of the whole job, and `fitlm plan` of the
same config (analytic). On a CPU the device is the host: the budget is what one device may hold, and the
measurement is of tensors, not of the process's resident set (which adds the Python and torch runtime).
Activation offload is not a row: on a CPU device there is no other memory to move activations to.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import RESULTS, prepare_data  # noqa: E402

MiB = 2**20
# Small and narrow, so the step's memory is activations (growing with the sequence) rather than weights.
MODEL = {
    "arch": "llama",
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 1024,
    "tie_embeddings": False,
}
LAYOUTS = {"single": {}, "cp2": {"context_parallel": 2}}


def config(data: Path, out: Path, seq: int, parallel: dict, document_mask: bool) -> dict:
    return {
        "model": {**MODEL, "max_seq_len": seq},
        "parallel": parallel,
        "memory": {"loss_chunk_size": 1024},  # the [T, V] logits would otherwise dominate
        "data": {"train": str(data), "seq_length": seq, "document_mask": document_mask},
        "train": {
            "micro_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "max_steps": 10**6,
            "warmup_steps": 0,
            "eval_interval": 0,
            "progress": False,
            "output_dir": str(out),
            "observe": {"tensorboard": False, "consistency_interval": 0},
        },
    }


def fitlm(*args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "fitlm.cli", *args, "--json"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"fitlm {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(name: str, parallel: dict, seq: int, steps: int, root: Path, data: Path, document_mask: bool) -> dict:
    import yaml

    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(data, root / name, seq, parallel, document_mask)))
    nproc = max(1, parallel.get("context_parallel", 1))
    prof = fitlm(
        "profile", str(path), "--steps", str(steps), "--nproc", str(nproc), "--out", str(root / f"{name}-prof")
    )
    plan = fitlm("plan", str(path))
    return {
        "layout": name,
        "processes": nproc,
        "measured_peak_bytes": prof["peak_bytes"],
        "measured": prof["per_device"],
        "planned_peak_bytes": plan.get("per_device", {}).get("total"),
        "planned": plan.get("per_device"),
        "tokens_per_s": prof["tokens_per_s"],
        "step_time_s": prof["step_time_s"],
    }


def table(rows: list[dict], budget: int, seq: int, document_mask: bool) -> str:
    lines = [
        f"sequence {seq} tokens, document mask {'on' if document_mask else 'off'}, "
        f"budget {budget / MiB:.0f} MiB per device",
        "",
        "| layout | processes | measured peak (MiB) | planned (MiB) | activations measured / planned (MiB) | "
        "fits the budget | tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        planned = r["planned_peak_bytes"]
        act_p = (r["planned"] or {}).get("activations")
        lines.append(
            f"| {r['layout']} | {r['processes']} | {r['measured_peak_bytes'] / MiB:.1f} | "
            f"{planned / MiB if planned else float('nan'):.1f} | {r['measured']['activations'] / MiB:.1f} / "
            f"{act_p / MiB if act_p else float('nan'):.1f} | "
            f"{'yes' if r['measured_peak_bytes'] <= budget else 'no'} | {r['tokens_per_s']:.0f} |"
        )
    single, cp2 = rows[0], rows[-1]
    lines.append("")
    lines.append(
        f"cp2 / single: peak {cp2['measured_peak_bytes'] / single['measured_peak_bytes']:.2f}x, "
        f"tokens/s {cp2['tokens_per_s'] / single['tokens_per_s']:.2f}x"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--budget-mib", type=float, default=320.0)
    ap.add_argument(
        "--document-mask",
        action="store_true",
        help="block-causal attention (one process: a [T, T] mask that SDPA converts per layer)",
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    args = ap.parse_args()
    budget = int(args.budget_mib * MiB)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = prepare_data(root)
        rows = [
            measure(name, par, args.seq, args.steps, root, data, args.document_mask) for name, par in LAYOUTS.items()
        ]
    print(table(rows, budget, args.seq, args.document_mask))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "seq": args.seq,
                "budget_bytes": budget,
                "document_mask": args.document_mask,
                "model": MODEL,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
