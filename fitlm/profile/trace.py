"""What torch.profiler can tell about a few training steps: time in collectives, memory by operator.

Communication: the profiler records every c10d collective as it runs (`gloo:all_reduce`,
`nccl:all_reduce`, `c10d::allgather_`, ...). Their time on the host is taken as communication time;
collectives that run asynchronously under compute (DDP's bucketed all-reduce during backward on
CUDA streams) are only partly visible there, so the share is what the step *waited* for, not the
traffic volume. Memory by operator: with `profile_memory` each aten op reports the bytes it
allocated less what it freed within the same call, summed over its calls. A tensor freed later, by
another op, is not subtracted from the op that made it, so this ranks the ops that allocate most (the
candidates for fusing, chunking or recompute); what stays alive is the per-module table's job.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

# Substrings of profiler event names that are collectives or point-to-point transfers.
_COMM_MARKERS = (
    "gloo:",
    "nccl:",
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reduce_scatter",
    "_reduce_scatter",
    "broadcast",
    "alltoall",
    "all_to_all",
    "c10d::send",
    "c10d::recv",
    "c10d::recv_any",
    "barrier",
)
# When the backend-level events exist (they hold the transfer time), the c10d wrappers around them
# would count the same time twice: prefer the backend's.
_BACKEND = ("gloo:", "nccl:")


def is_collective(name: str) -> bool:
    lowered = name.lower()
    return any(m in lowered for m in _COMM_MARKERS) and not lowered.startswith("profilerstep")


def trace_steps(run_step: Callable[[], object], steps: int, device: torch.device) -> dict:
    """Run `steps` steps under torch.profiler; returns communication seconds per step (with the ops
    that made it), the profiled steps' wall time, and the operators by net bytes allocated."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            run_step()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    comm = {e.key: e.cpu_time_total / 1e6 / steps for e in averages if is_collective(e.key)}
    if any(k.lower().startswith(_BACKEND) for k in comm):
        comm = {k: v for k, v in comm.items() if k.lower().startswith(_BACKEND)}
    ops = []
    for e in averages:
        nbytes = e.self_device_memory_usage if device.type == "cuda" else e.self_cpu_memory_usage
        if nbytes > 0 and e.key.startswith("aten::"):
            ops.append({"op": e.key, "bytes": int(nbytes) // steps, "calls": e.count // steps})
    ops.sort(key=lambda r: -r["bytes"])
    step_s = wall / steps
    comm_s = sum(comm.values())
    return {
        "comm_s": comm_s,
        "comm_share": comm_s / step_s if step_s else 0.0,
        "step_s": step_s,
        "comm_ops": dict(sorted(comm.items(), key=lambda kv: -kv[1])),
        "ops": ops[:15],
    }
