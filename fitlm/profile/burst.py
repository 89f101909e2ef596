"""The measured burst, run on every rank: timed steps, a traced pair, a memory-tracked pair; gathered to rank 0.

Order, after the real `Trainer` is built for the configured layout (into a scratch output directory):
  1. `steps` timed steps (`Trainer.train_step`, phase wall times from its PhaseTimer, device-synced
     on CUDA); the first is warm-up (optimizer states, thread pools) and is left out of the averages;
  2. two steps under torch.profiler (communication time, memory by operator; see trace.py);
  3. steps under MemTracker (fitlm.memory.tracking.track_step): one warm-up, then one measured (the least of
     three under gloo, `measured_steps_for`), giving peak live tensor bytes by category and per module.
Each phase gets its own steps so that no instrument slows the steps another one times.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fitlm.config import Config, validate_dict
from fitlm.finetune.init_from import resolve_init_from
from fitlm.hardware import peak_memory_bytes
from fitlm.memory.tracking import measured_steps_for, plan_components, track_step
from fitlm.profile.trace import trace_steps
from fitlm.train.progress import TrainProgress

TRACED_STEPS = 2
TRACKED_STEPS = 4  # one warm-up, then up to three measured (MemTracker; see measured_steps_for)
SCRATCH = "burst"  # the burst's own train.output_dir, under the profile's output directory


def burst_config(cfg: Config, out: Path, steps: int) -> Config:
    """The config the burst trains: the user's, with its output, checkpoints, evaluation and progress bar
    redirected or off, so the burst never touches train.output_dir or the user's checkpoints."""
    # Resolve model.init_from before serialising: the dump sets every key, so the user's config,
    # validated again unresolved, would contradict the weights in each default it spells out.
    data = resolve_init_from(cfg).to_dict()
    data["train"].update(
        output_dir=str(out / SCRATCH),
        max_steps=steps + TRACED_STEPS + TRACKED_STEPS,
        eval_interval=0,
        early_stopping_patience=0,
        progress=False,
    )
    data["checkpoint"].update(interval=0, resume="never")
    return validate_dict(data, "fitlm profile")


def _say(main: bool, text: str) -> None:
    if main:
        print(f"fitlm profile: {text}", file=sys.stderr, flush=True)


def run_burst(cfg: Config, steps: int, out: Path) -> list[dict] | None:
    """Train the burst on this rank and measure it; returns every rank's results on rank 0, None elsewhere."""
    from fitlm.parallel.mesh import shutdown
    from fitlm.train.trainer import Trainer

    trainer = Trainer(burst_config(cfg, out, steps))
    ctx, device, main = trainer.ctx, trainer.device, trainer.ctx.is_main
    trainer.step.timer.sync = device.type == "cuda"  # exact phase times: wait for the device at each boundary
    batches = trainer.batches()
    count = 0
    loads: list[float] = []  # an MoE model's expert load of each step (fitlm.step.router_balance)

    def one_step():
        nonlocal count
        count += 1
        step = trainer.train_step(count, batches)
        balance = trainer.step.balance
        if balance is not None and "expert_load" in balance.metrics:
            loads.append(balance.metrics["expert_load"])
        return step

    _say(main, f"{steps} timed steps, world size {ctx.world_size}, {trainer.tokens_per_step:,} tokens per step")
    records = timed_steps(one_step, steps, trainer.tokens_per_step, cfg.train.log_interval, main)
    _say(main, f"tracing {TRACED_STEPS} steps with torch.profiler")
    traced = trace_steps(one_step, TRACED_STEPS, device)
    _say(main, "measuring peak live tensor bytes (MemTracker) on one step")
    memory, memory_error = None, None
    try:
        measured = measured_steps_for(ctx.distributed, device)
        memory = track_step(one_step, trainer.pm.modules, trainer.step.optimizer, 1, measured)
    except Exception as exc:  # noqa: BLE001 - a tracker limitation must not lose the timing results
        memory_error = f"{type(exc).__name__}: {exc}"
    result = summarize(trainer, records, traced, memory, memory_error)
    result["expert_load"] = max(loads) if loads else None  # for `fitlm plan --expert-load` (fitlm.plan.routing)
    gathered: list[Any] | None = [result]  # (every rank's result dict on rank 0, once gathered)
    if ctx.distributed:
        import torch.distributed as dist

        gathered = [None] * ctx.world_size if main else None
        dist.gather_object(result, gathered, dst=0)
        ctx.barrier()
    shutdown(ctx)
    if main:
        shutil.rmtree(out / SCRATCH, ignore_errors=True)
    return gathered if main else None


def timed_steps(one_step, steps: int, tokens_per_step: int, log_interval: int, main: bool) -> list[dict]:
    """`steps` timed steps; progress as training shows it (a bar, or a line each log_interval steps)."""
    records: list[dict] = []
    logged = 0  # records already shown: a line's tokens/s is its window's, as in training
    with TrainProgress(steps, enabled=main, what="profile") as progress:
        for i in range(1, steps + 1):
            start = time.perf_counter()
            step = one_step()
            loss = step.loss.item()  # waits for the device: the step is done
            wall = time.perf_counter() - start
            records.append(
                {
                    "step": i,
                    "loss": loss,
                    "grad_norm": float(step.grad_norm),
                    "skipped": step.skipped,
                    "step_s": wall,
                    "tokens_per_s": tokens_per_step / wall,
                    "phases_s": step.seconds,
                }
            )
            if i % log_interval == 0 or i in (1, steps):
                window = records[logged:]
                speed = tokens_per_step * len(window) / sum(r["step_s"] for r in window)
                progress.update(i, loss=loss, tokens_per_s=speed)
                logged = i
            else:
                progress.update(i)
    return records


def summarize(trainer, records: list[dict], traced: dict, memory, memory_error: str | None) -> dict:
    """One rank's results as plain JSON-able values."""
    ctx, device = trainer.ctx, trainer.device
    timed = records[1:] or records  # the first step is warm-up
    step_s = sum(r["step_s"] for r in timed) / len(timed)
    phases = sorted({k for r in timed for k in r["phases_s"]})
    phase_s = {k: sum(r["phases_s"].get(k, 0.0) for r in timed) / len(timed) for k in phases}
    phase_s["other"] = max(0.0, step_s - sum(phase_s.values()))  # host work outside the timed phases
    tokens_per_s = trainer.tokens_per_step / step_s
    out = {
        "rank": ctx.rank,
        "dp_rank": ctx.dp_rank,
        "tp_rank": ctx.tp_rank,
        "pp_rank": ctx.pp_rank,
        "device": str(device),
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * trainer.flops_per_token / (trainer.peak_flops * ctx.world_size),
        "flops_per_token": trainer.flops_per_token,
        "peak_flops": trainer.peak_flops,
        "tokens_per_step": trainer.tokens_per_step,
        "phase_s": phase_s,
        "steps": records,
        "comm": traced,
        "rss_peak_bytes": peak_memory_bytes(torch.device("cpu")),
        "cuda_peak_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        "memory": plan_components(memory.peak) if memory else None,
        "memory_categories": memory.peak if memory else None,
        "modules": memory.modules if memory else [],
        "memory_error": memory_error,
    }
    return out
