"""Peak memory and step time of each memory option against the fp32 baseline, on this machine.

Not a test: it prints a table and writes JSON. One small Llama whose 8K vocabulary makes the logits a
large share of memory (as a 32K-128K vocabulary does in real models), the same data and global batch
for every option. Each option runs in its own process, so RSS is that option's alone. (On this CPU,
torch 2.13's bf16 matmuls with a long reduction dimension, such as the output layer's backward over
the vocabulary, are far slower than fp32: half-precision step times here say nothing about a GPU.)

Memory is measured, not estimated: `peak_live` is the peak of bytes held by live tensors during one
training step (torch's MemTracker, see fitlm/memory/tracking.py), split into parameters, gradients,
optimizer states, activations and temporaries; `rss` is the process's peak resident set (allocator
caches, the runtime and torch.compile's work included). On CUDA the allocator peak would be reported.
Beside it, the planner's two predictions for the same config (`fitlm plan`: the analytic total and the
fake-tensor simulation's), so the table shows plan vs measured. The fine-tuning rows (LoRA, freeze)
train the same randomly initialised model: memory does not depend on the weights' values. QLoRA's rows
(issue #20) store the block Linears as 4-bit NF4 (torchao); two rows repeat LoRA and QLoRA on a model whose
Linears hold most of its weights, as real models' do.

    python bench/memory.py [--steps 6] [--out bench/results/memory.json] [--only NAME ...] [--markdown]
    python bench/memory.py --table-only --markdown      # the table of an earlier run, for README/RESULTS
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PLAYS = ROOT / "examples" / "data" / "shakespeare"

MODEL = {
    "arch": "llama",
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 8192,
    "max_seq_len": 256,
    "tie_embeddings": False,
}
BATCH = {"micro_batch_size": 8, "gradient_accumulation_steps": 1}

# name -> config sections that differ from the baseline (model, memory, train, finetune). Every row trains the
# same 8 x 256 tokens per step (accumulation splits them into micro batches). The baseline trains every
# parameter: it is the full fine-tuning row too.
LORA_QV = {"method": "lora", "lora": {"r": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}}
QLORA_QV = {**LORA_QV, "method": "qlora"}  # the same adapters on the block Linears stored in 4-bit NF4
# The model above keeps 59% of its weights in the embedding and the head, which QLoRA leaves as they are; real
# models keep most in the block Linears (Llama 3 8B: 87%). This shape does too (92%), with the tokenizer's 1024
# ids, so its rows show QLoRA's parameter bytes where Linears dominate.
LINEAR_HEAVY = {"hidden_size": 512, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408, "vocab_size": 1024}
OPTIONS: dict[str, dict[str, dict]] = {
    "baseline (O0 fp32)": {},
    "O1 bf16 autocast": {"memory": {"mixed_precision": "O1"}},
    "O2 bf16": {"memory": {"mixed_precision": "O2"}},
    "O3 bf16": {"memory": {"mixed_precision": "O3"}},
    "O2 fp16 + loss scaling": {"memory": {"mixed_precision": "O2", "half_dtype": "fp16"}},
    "recompute full": {"memory": {"recompute": "full"}},
    "recompute selective": {"memory": {"recompute": "selective"}},
    "chunked loss (1024)": {"memory": {"loss_chunk_size": 1024}},
    "cpu offload": {"memory": {"cpu_offload": True}},
    "accumulation 4 × micro batch 2": {"train": {"micro_batch_size": 2, "gradient_accumulation_steps": 4}},
    "compile": {"memory": {"compile": True}},
    "O2 + chunked + selective + compile": {
        "memory": {"mixed_precision": "O2", "loss_chunk_size": 1024, "recompute": "selective", "compile": True}
    },
    "LoRA r=8 (q,v)": {"finetune": LORA_QV},
    "LoRA r=8 (q,v) + O2 bf16": {"finetune": LORA_QV, "memory": {"mixed_precision": "O2"}},
    "freeze bottom half": {"finetune": {"method": "freeze", "freeze_layers": 0.5}},
    "QLoRA r=8 (q,v)": {"finetune": QLORA_QV},
    "QLoRA r=8 (q,v) + O2 bf16": {"finetune": QLORA_QV, "memory": {"mixed_precision": "O2"}},
    "h512 vocab 1024: LoRA r=8 (q,v) + O2 bf16": {
        "model": LINEAR_HEAVY,
        "finetune": LORA_QV,
        "memory": {"mixed_precision": "O2"},
    },
    "h512 vocab 1024: QLoRA r=8 (q,v) + O2 bf16": {
        "model": LINEAR_HEAVY,
        "finetune": QLORA_QV,
        "memory": {"mixed_precision": "O2"},
    },
}


def prepare_data(root: Path) -> None:
    from fitlm.data.prep.pack import pack_corpus
    from fitlm.data.prep.tokenizer_train import train_tokenizer

    tok = train_tokenizer([PLAYS / "macbeth_gut.txt"], 1024, root / "tokenizer.json")
    pack_corpus([PLAYS / "macbeth_gut.txt"], tok, root / "train", show_progress=False)


def measure(root: Path, name: str, steps: int) -> dict:
    """Runs in a child process: build the trainer for one option, time `steps` steps, then measure one."""
    import torch

    from fitlm.config import validate_dict
    from fitlm.memory.tracking import peak_live_bytes
    from fitlm.train.trainer import Trainer

    sections = OPTIONS[name]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = validate_dict(
        {
            "model": {**MODEL, **sections.get("model", {})},
            "memory": sections.get("memory", {}),
            "finetune": sections.get("finetune", {}),
            "data": {"train": str(root / "train"), "seq_length": 256},
            "train": {
                **BATCH,
                **sections.get("train", {}),
                "max_steps": 1000,
                "warmup_steps": 0,
                "eval_interval": 0,
                "progress": False,
                "output_dir": str(root / "runs" / name.replace(" ", "_").replace("/", "_")),
            },
        }
    )
    planned = plan_totals(cfg)
    trainer = Trainer(cfg)
    batches = iter(trainer.loader)
    accum = cfg.train.gradient_accumulation_steps
    count = iter(range(1, 10**6))

    def step():  # the trainer's own step: data, forward/backward, optimizer (and its guards)
        trainer.train_step(next(count), batches)

    for _ in range(2):  # warm up: optimizer states, allocator, compilation
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    live = peak_live_bytes(step, trainer.pm.modules, trainer.step.optimizer, warmup_steps=0)
    tokens = cfg.train.micro_batch_size * accum * cfg.data.seq_length
    return {
        "option": name,
        "step_s": statistics.median(times),
        "tokens_per_s": tokens / statistics.median(times),
        "peak_live_bytes": live,
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **planned,
    }


def plan_totals(cfg) -> dict:
    """The planner's analytic and simulated per-device totals for this config (None where it cannot simulate)."""
    from fitlm.plan.analytic import breakdown
    from fitlm.plan.setup import from_config
    from fitlm.plan.simulate import run_step

    out = {"plan_analytic_bytes": breakdown(from_config(cfg)).total, "plan_simulated_bytes": None}
    try:
        out["plan_simulated_bytes"] = run_step(cfg)["total"]
    except Exception as e:  # noqa: BLE001 - e.g. torch.compile under fake tensors: report, keep measuring
        out["plan_simulate_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per option (median reported)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory.json")
    ap.add_argument("--only", nargs="*", help="option names to run (default: all)")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (for README and RESULTS)")
    ap.add_argument("--table-only", action="store_true", help="measure nothing: print the table of --out")
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        print(json.dumps(measure(Path(args._worker[0]), args._worker[1], args.steps)))
        return
    if args.table_only:
        print_table(json.loads(args.out.read_text())["rows"], markdown=args.markdown)
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_data(root)
        for name in args.only or OPTIONS:
            proc = subprocess.run(
                [sys.executable, __file__, "--steps", str(args.steps), "--_worker", str(root), name],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"measured {name}", file=sys.stderr, flush=True)
            write(args.out, rows)  # after every option, so a long run interrupted keeps what it measured
    print_table(rows, markdown=args.markdown)
    write(args.out, rows)
    print(f"wrote {args.out}", file=sys.stderr)


COLUMNS = (
    "option",
    "peak live MiB",
    "vs baseline",
    "params",
    "grads",
    "optimizer",
    "activations",
    "temp",
    "plan analytic",
    "plan simulated",
    "RSS MiB",
    "step s",
    "time vs baseline",
)


def print_table(rows: list[dict], markdown: bool = False) -> None:
    """The table of `rows` (the first is the baseline): a rich table, or markdown for README/RESULTS."""
    from rich.console import Console
    from rich.table import Table

    base, mib = rows[0], 2**20
    cells = []
    for r in rows:
        live = r["peak_live_bytes"]
        r["memory_ratio"] = live["total"] / base["peak_live_bytes"]["total"]
        r["time_ratio"] = r["step_s"] / base["step_s"]
        cells.append(
            [
                r["option"],
                f"{live['total'] / mib:.1f}",
                f"{r['memory_ratio']:.2f}×",
                *(f"{live[k] / mib:.1f}" for k in ("params", "grads", "optimizer", "activations", "temporaries")),
                *(_vs(r.get(k), live["total"]) for k in ("plan_analytic_bytes", "plan_simulated_bytes")),
                f"{r['rss_bytes'] / mib:.0f}",
                f"{r['step_s']:.3f}",
                f"{r['time_ratio']:.2f}×",
            ]
        )
    if markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("| --- |" + " ---: |" * (len(COLUMNS) - 1))
        for row in cells:
            print("| " + " | ".join(row) + " |")
        return
    table = Table(
        title=f"memory options: Llama h{MODEL['hidden_size']} L{MODEL['num_layers']} vocab {MODEL['vocab_size']}, "
        f"{BATCH['micro_batch_size']}×256 tokens per step, CPU"
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "option" else "right")
    for row in cells:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 220).print(table)


def _vs(planned: int | None, measured: int) -> str:
    """A planner total in MiB with its error against the measured peak."""
    if planned is None:
        return "n/a"
    return f"{planned / 2**20:.1f} ({planned / measured - 1:+.1%})"


def write(out: Path, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "batch": BATCH, "seq_length": 256, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
