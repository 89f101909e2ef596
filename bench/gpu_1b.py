"""A ~1B Llama on one GPU with fitlm's pieces: FSDP2 + torch.compile + bf16 (issue #11). Prepared for when
an accelerator is available; `--dry-run` runs the same code path on CPU/gloo with a tiny model.

Not a test: it prints a summary (or one JSON object) and writes JSON. One process joins a one-rank
process group (nccl on CUDA, gloo on CPU) and builds, in fitlm's documented order (fitlm.parallel.apply):

    fitlm Llama (TinyLlama-1.1B shape: h2048, 22 layers, 32 heads / 4 kv heads, MLP 5632, vocab 32000)
    -> precision O2 bf16 (FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 master weights and reduction)
    -> torch.compile per block -> chunked output layer + loss -> FSDP2 fully_shard per block, then root
    -> AdamW (fitlm.step.optim.build_optimizer)

then trains on packed data (Macbeth, bench/common.prepare_data; the 32K vocabulary is the model's) for
`--warmup` untimed steps (compilation) and `--steps` timed ones, and reports tokens/s, MFU against the
device's bf16 peak (datasheet on GPU, fitlm.hardware.device_peak_flops), the allocator peak
(torch.cuda.max_memory_allocated), the compile time, and `fitlm plan`'s prediction for the same run
(fitlm.plan.report.plan: per-device memory, step time, tokens/s, MFU) beside the measurement.
On one rank FSDP2 shards nothing; it is here so the exact multi-GPU code path (gather, bf16 cast,
fp32 reduce) is what gets timed. Expected end to end on an H100/H200 (an estimate: not yet run on a
GPU): ~1 min setup + compile, ~1 min of steps; well under 8 minutes.

    python bench/gpu_1b.py [--batch 4] [--seq 2048] [--steps 10] [--warmup 3] [--no-compile] [--json]
                           [--out bench/results/gpu_1b.json]
    python bench/gpu_1b.py --dry-run      # CPU, tiny model, 2+1 steps: checks the path without a GPU
                                          # (writes JSON only with --out)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, fitlm_config, machine, median, prepare_data, write_json  # noqa: E402

ONE_B = {
    "hidden_size": 2048,
    "num_layers": 22,
    "num_heads": 32,
    "num_kv_heads": 4,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "tie_embeddings": False,
}
TINY = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 32000,
    "tie_embeddings": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_for(cfg, device: str) -> dict:
    """fitlm plan's prediction for one device running this config (no FSDP on one rank: zero_stage 0)."""
    import torch

    from fitlm.plan.devices import get_device
    from fitlm.plan.report import plan

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        key = next((k for k, n in (("h200", "H200"), ("h100-80g", "H100"), ("a100-80g", "A100")) if n in name), None)
        total = torch.cuda.get_device_properties(0).total_memory
        dev = get_device(key) if key else get_device(None, f"{total}", 989.0)
    else:
        dev = get_device("cpu")
    result = plan(cfg, dev, 1)
    keep = ("fits", "step_time_s", "tokens_per_s", "mfu", "per_device", "model")
    return {"device": dev.name, **{k: result[k] for k in keep if k in result}}


def run(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fitlm.data.dataset import PackedDataset
    from fitlm.data.loader import SequenceLoader
    from fitlm.hardware import device_peak_flops
    from fitlm.memory.chunked_loss import apply_chunked_loss
    from fitlm.memory.compile import apply_compile
    from fitlm.memory.precision import apply_precision, fsdp_mixed_precision
    from fitlm.memory.recompute import apply_recompute, transformer_blocks
    from fitlm.models.flops import flops_per_token
    from fitlm.models.loss import count_targets
    from fitlm.registry import build_model
    from fitlm.step.optim import build_optimizer

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    t_setup = time.perf_counter()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.set_float32_matmul_precision("high")
    shape = TINY if args.dry_run else ONE_B
    tmp = Path(tempfile.mkdtemp())
    data_dir = prepare_data(tmp)
    memory = {
        "mixed_precision": "O2",
        "half_dtype": "bf16",
        "compile": args.compile,
        "loss_chunk_size": args.chunk,
        "recompute": args.recompute,
    }
    cfg = fitlm_config(shape, data_dir, tmp / "run", args.batch, args.seq, memory, device=device)
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    fpt = flops_per_token(model, cfg.model, args.seq)
    params = sum(p.numel() for p in model.parameters())
    # fitlm.parallel.apply's order: precision (FSDP2 owns O2's casts) -> recompute -> compile -> chunked loss -> FSDP2.
    apply_precision(model, cfg.memory, sharded=True)
    apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_every_n_layers)
    apply_compile(model, cfg.memory)  # per block: FSDP2 wraps the blocks below
    apply_chunked_loss(model, cfg.memory.loss_chunk_size, compiled=cfg.memory.compile)
    policy = dict(mesh=mesh, mp_policy=fsdp_mixed_precision(cfg.memory), reshard_after_forward=True)
    for block in transformer_blocks(model):
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    optimizer = build_optimizer(model, cfg.train)
    loader = SequenceLoader.from_config(PackedDataset(data_dir), cfg.data, args.batch, seed=cfg.train.seed)
    setup_s = time.perf_counter() - t_setup

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step() -> float:
        b = next(loader)
        ids, labels = b["input_ids"].to(device), b["labels"].to(device)
        loss = model(ids, labels=labels) / max(1, count_targets(labels))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - t0)
        if device == "cuda" and len(times) == args.warmup:
            torch.cuda.reset_peak_memory_stats()
    step_s = median(times[args.warmup :])
    tokens = args.batch * args.seq
    peak_flops = device_peak_flops(torch.device(device), torch.bfloat16, None)
    tps = tokens / step_s
    result = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)" if args.dry_run else "cpu",
        "model": shape,
        "params": params,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_per_step": tokens,
        "settings": f"FSDP2 (1 rank) + O2 bf16 + {'compile + ' if args.compile else ''}chunked loss {args.chunk}"
        + (f" + recompute {args.recompute}" if args.recompute != "none" else ""),
        "setup_s": round(setup_s, 1),
        "compile_s": round(max(0.0, sum(times[: args.warmup]) - args.warmup * step_s), 1),
        "step_s": round(step_s, 4),
        "step_times_s": [round(t, 4) for t in times],
        "tokens_per_s": round(tps, 1),
        "flops_per_token": fpt,
        "peak_flops": peak_flops,
        "mfu": round(tps * fpt / peak_flops, 4),
        "loss_first_last": [round(float(losses[0]), 4), round(float(losses[-1]), 4)],
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
    }
    plan_cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"compile": args.compile})})
    try:
        result["plan"] = plan_for(plan_cfg, device)
        p = result["plan"]
        if p.get("tokens_per_s"):
            result["measured_vs_plan_tokens_per_s"] = round(tps / p["tokens_per_s"], 3)
        total = (p.get("per_device") or {}).get("total")
        if total and result["peak_bytes"]:
            result["measured_vs_plan_peak_bytes"] = round(result["peak_bytes"] / total, 3)
    except Exception as e:  # the measurement stands on its own; say why the plan is missing
        result["plan_error"] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU + gloo, tiny model, 2 warm-up + 1 timed step")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=4096, help="memory.loss_chunk_size")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.dry_run:
        args.batch, args.seq, args.steps, args.warmup, args.chunk = 2, 64, 1, 2, 32
    t0 = time.perf_counter()
    result = run(args)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["machine"] = machine()
    # A dry run checks the path; it leaves the results file alone unless --out is given.
    out = args.out or (None if args.dry_run else RESULTS / "gpu_1b.json")
    if out:
        write_json(out, result)
    if args.json:
        print(json.dumps(result))
        return
    for k in (
        "device",
        "params",
        "settings",
        "setup_s",
        "compile_s",
        "step_s",
        "tokens_per_s",
        "mfu",
        "peak_bytes",
        "plan",
        "measured_vs_plan_tokens_per_s",
        "measured_vs_plan_peak_bytes",
        "plan_error",
        "wall_s",
    ):
        if k in result:
            print(f"{k:>30}  {result[k]}")
    if out:
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
