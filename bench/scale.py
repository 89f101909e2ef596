"""Host memory of a ~0.7B model fine-tuned from a Hugging Face directory, per process and phase.

transformers creates a Llama of ~0.7B parameters with random weights and saves it (bf16
safetensors, as checkpoints are published). `fitlm train` then fine-tunes it for 2 steps in three
layouts on 2 gloo processes: LoRA under dp2 ZeRO-3, full fine-tuning under dp2 ZeRO-3, full
fine-tuning under tp2. Each run writes every rank's peak resident set for the load (build on the meta
device, read tensor by tensor, keep this rank's slices), the training steps and the final save
(gathered block by block) to output_dir/host_memory.json; this script prints them beside the
model's fp32 size and what `fitlm plan` predicts for the host.

    python bench/scale.py [--out bench/results/scale.json] [--markdown] [--layers 12] [--mmap-threshold 65536]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml
from bytes_per_param import ROOT, fitlm, prepare  # run as a script: bench/ is on sys.path

GIB = 2**30
LORA = {"method": "lora", "lora": {"r": 16, "alpha": 32, "target_modules": ["all-linear"]}}
RUNS = [  # (name, finetune, parallel, memory)
    ("LoRA, dp2 ZeRO-3", LORA, {"data_parallel": 2, "zero_stage": 3}, {}),
    ("LoRA O2 (bf16), dp2 ZeRO-3", LORA, {"data_parallel": 2, "zero_stage": 3}, {"mixed_precision": "O2"}),
    ("full, dp2 ZeRO-3", {"method": "full"}, {"data_parallel": 2, "zero_stage": 3}, {}),
    ("full, tp2", {"method": "full"}, {"tensor_parallel": 2}, {}),
]


def make_hf_model(path: Path, layers: int) -> int:
    """A random ~0.7B Llama (at 12 layers) saved by transformers in bf16; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(path)
    return n


def config(tmp: Path, name: str, hf: Path, data: Path, tok: Path, finetune: dict, parallel: dict, memory: dict) -> Path:
    cfg = {
        "model": {"init_from": str(hf)},
        "finetune": finetune,
        "parallel": parallel,
        "memory": memory,
        "data": {"train": str(data), "tokenizer": str(tok), "seq_length": 128},
        "train": {
            "micro_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "max_steps": 2,
            "eval_interval": 0,
            "warmup_steps": 0,
            "log_interval": 1,
            "progress": False,
            "output_dir": str(tmp / name),
            "observe": {"consistency_interval": 0, "tensorboard": False},
        },
        "checkpoint": {"interval": 0},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def plan_host(cfg: Path) -> dict | None:
    """The plan's host-memory figures (bytes per rank at load / step / save), where the planner gives them."""
    proc = fitlm("plan", str(cfg), "--device", "cpu", "--json")
    if proc.returncode:
        return None
    try:
        return json.loads(proc.stdout).get("host")
    except ValueError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--only", type=int, nargs="+", help="run only RUNS[N] (several: --only 2 3)")
    ap.add_argument(
        "--mmap-threshold",
        type=int,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the runs (bytes): "
        "allocations above it are returned to the system when freed instead of kept in the heap",
    )
    args = ap.parse_args()
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # inherited by torchrun and the ranks
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        hf = tmp / "hf"
        params = make_hf_model(hf, args.layers)
        tok, data = prepare(tmp)
        fp32 = params * 4
        for i, (name, finetune, parallel, memory) in enumerate(RUNS):
            if args.only is not None and i not in args.only:
                continue
            slug = f"run{i}"
            cfg = config(tmp, slug, hf, data, tok, finetune, parallel, memory)
            start = time.perf_counter()
            proc = fitlm("train", str(cfg), "--nproc", "2")
            seconds = time.perf_counter() - start
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                rows.append({"run": name, "error": proc.stderr.strip().splitlines()[-1]})
                continue
            host = json.loads((tmp / slug / "host_memory.json").read_text())
            rows.append(
                {
                    "run": name,
                    "seconds": round(seconds, 1),
                    "params": params,
                    "fp32_bytes": fp32,
                    "peaks": host,
                    "plan": plan_host(cfg),
                    "max_peak_over_half_fp32": max(max(v) for v in host.values()) - fp32 / 2,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    out = {
        "machine": {"python": sys.version.split()[0]},
        "layers": args.layers,
        "mmap_threshold": args.mmap_threshold,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.markdown:
        print("| run | phase | rank 0 (GiB) | rank 1 (GiB) | plan (GiB) |")
        print("| --- | --- | --- | --- | --- |")
        for r in rows:
            if "error" in r:
                print(f"| {r['run']} | error: {r['error']} | | | |")
                continue
            for phase, ranks in r["peaks"].items():
                planned = ((r["plan"] or {}).get("per_rank") or {}).get(phase)
                cells = " | ".join(f"{b / GIB:.2f}" for b in ranks)
                print(
                    f"| {r['run']} | {phase} | {cells} | {planned / GIB:.2f} |"
                    if planned
                    else f"| {r['run']} | {phase} | {cells} | n/a |"
                )
        print(
            f"\nModel: {rows[0].get('params', 0) / 1e9:.2f}B parameters, fp32 {rows[0].get('fp32_bytes', 0) / GIB:.2f} GiB "
            f"(half: {rows[0].get('fp32_bytes', 0) / 2 / GIB:.2f} GiB)"
        )


if __name__ == "__main__":
    main()
