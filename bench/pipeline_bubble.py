"""Pipeline bubble on this machine (CPU, gloo, issue #17): step time and idle fraction of the pp ranks as the
chunks per optimizer step grow, and one schedule run per step (now) against one run per accumulation micro batch
(before).

Not a test: it prints tables and writes JSON.

    python bench/pipeline_bubble.py [--steps 4] [--repeats 3] [--pp 2 4] [--old-root DIR] [--out FILE.json]

Each row is a real `TrainStep` (the trainer's step: `parallelize`, `forward_backward`, `optimizer_step`) on `pp`
gloo processes with one thread each, on random ids (the compute does not depend on them).

How the bubble is measured: every rank adds up the wall time it spends inside torch's stage compute
(`forward_one_chunk`, `backward_one_chunk` and the loss), which excludes the waits on point-to-point receives; then
bubble = 1 - (sum over ranks of that compute) / (pp × forward_backward wall time), the median over the measured
steps. It is the fraction of rank time not spent computing, so besides the schedule's fill and drain it also holds
the transfers through gloo and any imbalance between stages (the last one computes the head and the loss). The
ideal is (p-1)/(n+p-1) with n chunks per schedule run: m·G now, m before (paid G times).

Old against new, two ways. In the same processes: the trainer's step (one schedule run) and the step as it was
(one run per accumulation micro batch, through `Pipeline.step(..., micro_batches=1)`), taken in turns step by
step, so both see the same code and the same moment's load. And `--old-root DIR`: the step of the fitlm package
in DIR (before issue #17's change, e.g. `git archive <commit> fitlm | tar -x -C DIR`), beside `--new-root DIR`
for the other rows (default: this checkout), so that both can be one commit but for the change. (The
same-process rows' receive buffers count both schedules they build.)

Compute is also timed in CPU seconds of the rank's thread: on a shared machine, wall / CPU above 1 is time the
rank was runnable but not running, which a bubble measurement cannot tell from waiting. With more ranks than
cores (pp4 on 2 cores) a rank's idle time is another rank's compute, so a smaller bubble cannot shorten the step.

    python bench/pipeline_bubble.py --markdown [bench/results/pipeline_bubble.json]   # the RESULTS.md table
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # the package under test comes first (the subprocess of an --old-root row sets it)
    sys.path.insert(0, os.environ.get("BENCH_FITLM_ROOT", str(ROOT)))

SEQ = 256
MODEL = {
    "arch": "llama",
    "hidden_size": 256,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "max_seq_len": SEQ,
    "tie_embeddings": False,
}
WARMUP = 2  # steps not measured: the first runs the schedule's shape inference


def config(pp: int, mbs: int, chunks: int, accum: int) -> dict:
    return {
        "model": MODEL,
        "data": {"seq_length": SEQ, "document_mask": False},
        "parallel": {"pipeline_parallel": pp, "pipeline_schedule": "1f1b", "micro_batch_num": chunks},
        "train": {"micro_batch_size": mbs, "gradient_accumulation_steps": accum, "warmup_steps": 0},
    }


# --------------------------------------------------------------------------- one rank


def compute_timer():
    """Wrap torch's stage compute so each call's wall and CPU time are added to the returned counters."""
    from torch.distributed.pipelining import schedules, stage

    spent = [0.0, 0.0]  # wall seconds, CPU seconds of this thread

    def timed(fn):
        def call(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
                spent[1] += time.thread_time() - c0

        return call

    base = stage._PipelineStageBase
    base.forward_one_chunk = timed(base.forward_one_chunk)
    base.backward_one_chunk = timed(base.backward_one_chunk)
    schedules._PipelineSchedule._compute_loss = timed(schedules._PipelineSchedule._compute_loss)
    return spent


def recv_buffer_bytes(pipeline) -> int:
    """Bytes of the receive buffers torch's PipelineStages keep (one per chunk of a run, for activations coming
    in and for gradients coming back), over every schedule this rank built."""
    scheds = list(getattr(pipeline, "_schedules", {}).values()) or [pipeline.schedule]
    seen, total = set(), 0
    for sched in scheds:
        for st in sched.stages:
            for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
                for info in infos:
                    buf = getattr(info, "buffer", None)
                    if buf is not None and buf.data_ptr() not in seen:
                        seen.add(buf.data_ptr())
                        total += buf.numel() * buf.element_size()
    return total


def per_micro_batch(step, batches: list[dict]) -> None:
    """The pipelined forward/backward before issue #17: one schedule run per accumulation micro batch, each
    of micro_batch_num chunks (`Pipeline.step(..., micro_batches=1)`: such a schedule over the same stages)."""
    from fitlm.models.loss import count_targets

    n_targets = sum(count_targets(b["labels"]) for b in batches)
    for b in batches:
        step.pm.pipeline.step(b["input_ids"], b["labels"], 1.0 / n_targets, micro_batches=1)
    step.pm.finish_backward()


def worker(rank: int, world: int, port: int, spec: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fitlm.config import validate_dict
    from fitlm.parallel.apply import parallelize
    from fitlm.parallel.mesh import context_on_mesh
    from fitlm.parallel_dims import MESH_DIMS
    from fitlm.registry import build_model
    from fitlm.step.train_step import TrainStep

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    cfg = validate_dict(config(world, spec["mbs"], spec["chunks"], spec["accum"]))
    mesh = init_device_mesh("cpu", cfg.parallel.dims.mesh_shape, mesh_dim_names=MESH_DIMS)
    ctx = context_on_mesh(mesh, cfg.parallel.dims, torch.device("cpu"))
    torch.manual_seed(0)
    pm = parallelize(build_model(cfg.model), cfg, ctx)
    step = TrainStep.create(cfg, ctx, pm)
    g = torch.Generator().manual_seed(1)
    batches = [
        {
            "input_ids": torch.randint(0, 1024, (spec["mbs"], SEQ), generator=g),
            "labels": torch.randint(0, 1024, (spec["mbs"], SEQ), generator=g),
        }
        for _ in range(spec["accum"])
    ]
    spent = compute_timer()
    modes = [mode for mode, _, _ in spec["modes"]]  # several: taken in turns, step by step
    rows = []
    for i in range((WARMUP + spec["steps"]) * len(modes)):
        mode = modes[i % len(modes)]
        dist.barrier()
        spent[:] = [0.0, 0.0]
        t0 = time.perf_counter()
        if mode == "per_micro_batch":
            per_micro_batch(step, batches)
        else:  # the trainer's step as this package runs it
            step.forward_backward(batches)
        fb = time.perf_counter() - t0
        step.optimizer_step()
        rows.append(
            {
                "mode": mode,
                "fb_s": fb,
                "step_s": time.perf_counter() - t0,
                "compute_s": spent[0],
                "compute_cpu_s": spent[1],
            }
        )
    mine = {"rows": rows[WARMUP * len(modes) :], "recv_bytes": recv_buffer_bytes(pm.pipeline)}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        Path(out_dir, "ranks.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def run_world(spec: dict) -> None:
    """In the subprocess: spawn the pp ranks, then print one JSON line: a summary per mode."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(worker, args=(spec["pp"], port, spec, tmp), nprocs=spec["pp"], start_method="spawn")
        ranks = json.loads(Path(tmp, "ranks.json").read_text())
    p, chunks, out = spec["pp"], spec["chunks"] * spec["accum"], []
    for mode, _, runs in spec["modes"]:
        steps = [[row for row in r["rows"] if row["mode"] == mode] for r in ranks]  # [rank][step]
        per_step = list(zip(*steps))  # [step][rank]
        fb = [max(x["fb_s"] for x in st) for st in per_step]  # the step ends on every rank together
        busy = [sum(x["compute_s"] for x in st) for st in per_step]
        n = chunks // runs  # chunks per schedule run
        out.append(
            {
                "step_s": statistics.median(max(x["step_s"] for x in st) for st in per_step),
                "forward_backward_s": statistics.median(fb),
                "bubble": statistics.median(1 - b / (p * f) for b, f in zip(busy, fb)),
                "ideal": (p - 1) / (n + p - 1),
                "chunk_compute_ms": 1000 * statistics.median(busy) / chunks,
                "chunk_compute_cpu_ms": 1000
                * statistics.median(sum(x["compute_cpu_s"] for x in st) for st in per_step)
                / chunks,
                "recv_mib_max_rank": max(r["recv_bytes"] for r in ranks) / 2**20,
            }
        )
    print(json.dumps(out))


# --------------------------------------------------------------------------- driver


def measure(case: dict, steps: int) -> list[dict]:
    """One world for `case`; a row per mode (or error rows)."""
    spec = {k: case[k] for k in ("pp", "mbs", "chunks", "accum", "modes")} | {"steps": steps}
    rows = [
        {
            "case": name,
            "pp": case["pp"],
            "micro_batch_num": case["chunks"],
            "accumulation": case["accum"],
            "chunks_per_step": case["chunks"] * case["accum"],
            "schedule_runs_per_step": runs,
        }
        for _, name, runs in case["modes"]
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--run", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "BENCH_FITLM_ROOT": str(case["root"])},
    )
    wall = round(time.perf_counter() - t0, 1)
    if proc.returncode:
        lines = [x for x in proc.stderr.strip().splitlines() if "Error" in x or "parallel." in x]
        error = (lines[-1] if lines else proc.stderr.strip()[-200:])[:240]
        return [{**r, "wall_s": wall, "error": error} for r in rows]
    return [{**r, "wall_s": wall, **m} for r, m in zip(rows, json.loads(proc.stdout.strip().splitlines()[-1]))]


def cases(pps: list[int], new_root: Path, old_root: Path | None) -> list[dict]:
    """Worlds to measure: the layout, the package and its modes as (mode, row name, schedule runs per step)."""
    out = []
    for pp in pps:  # the sweep: m accumulation micro batches of one sequence, one chunk each
        out += [
            {
                "pp": pp,
                "mbs": 1,
                "chunks": 1,
                "accum": m,
                "root": new_root,
                "modes": [("step", f"pp{pp} sweep m={m}", 1)],
            }
            for m in (1, 2, 4, 8)
        ]
    for pp in pps:  # accumulation 4, micro_batch_num = pp: the smallest layout the old rule accepted
        same = {"pp": pp, "mbs": pp, "chunks": pp, "accum": 4}
        out.append(
            {
                **same,
                "root": new_root,
                "modes": [
                    ("step", f"pp{pp} accum4: one run (new)", 1),
                    ("per_micro_batch", f"pp{pp} accum4: run per micro batch, same processes", 4),
                ],
            }
        )
        if old_root is not None:
            out.append(
                {**same, "root": old_root, "modes": [("step", f"pp{pp} accum4: run per micro batch (old package)", 4)]}
            )
    return out


def table(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"- Machine: {m.get('cpus')} CPUs, load average {report.get('load_before', '?')} before and "
        f"{m.get('load_avg_1m', '?')} after; Python {m.get('python')}, torch {m.get('torch')}, gloo",
        f"- Command: `{report.get('command', 'python bench/pipeline_bubble.py')}`",
        f"- {report['steps']} measured steps per row (median, after {WARMUP} warm-up steps), fastest of "
        f"{report['repeats']} runs per row",
        "",
        "| case | chunks per step | schedule runs per step | step (s) | forward+backward (s) | compute per chunk, "
        "wall / CPU (ms) | bubble measured | bubble ideal | receive buffers, largest rank (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        if "error" in r:
            why = r["error"].split(";")[0].removeprefix("ValueError: ")  # the rule, not its remedy
            lines.append(f"| {r['case']} | {r['chunks_per_step']} | - | refused: {why} | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['chunks_per_step']} | {r['schedule_runs_per_step']} | {r['step_s']:.3f} | "
            f"{r['forward_backward_s']:.3f} | {r['chunk_compute_ms']:.0f} / {r['chunk_compute_cpu_ms']:.0f} | "
            f"{r['bubble']:.1%} | {r['ideal']:.1%} | {r['recv_mib_max_rank']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per row (after 2 warm-up steps)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each row; the fastest is reported")
    ap.add_argument("--new-root", type=Path, default=ROOT, help="the folder holding the fitlm package of the new rows")
    ap.add_argument(
        "--old-root", type=Path, default=None, help="the folder holding the fitlm package before the change"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pipeline_bubble.json")
    ap.add_argument(
        "--markdown",
        nargs="?",
        type=Path,
        const=ROOT / "bench" / "results" / "pipeline_bubble.json",
        metavar="JSON",
        help="print the bench/RESULTS.md table of a saved run and exit",
    )
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: one world, in a subprocess
    args = ap.parse_args()
    if args.run:
        run_world(json.loads(args.run))
        return
    if args.markdown:
        print(table(json.loads(args.markdown.read_text())))
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from common import machine, write_json

    load_before = round(os.getloadavg()[0], 2)
    todo = cases(args.pp, args.new_root, args.old_root)
    # The machine is shared: each row is measured --repeats times, round robin (old and new side by side in
    # time), and the repeat with the fastest forward+backward is kept (the least disturbed one).
    tries = []
    for rep in range(args.repeats):
        tries.append([row for case in todo for row in measure(case, args.steps)])
        print(f"round {rep + 1} of {args.repeats} measured", file=sys.stderr, flush=True)
    rows = [min(runs, key=lambda r: r.get("forward_backward_s", 0.0)) for runs in zip(*tries)]
    for row, runs in zip(rows, zip(*tries)):
        row["forward_backward_s_all"] = [round(r["forward_backward_s"], 4) for r in runs if "error" not in r]
    report = {
        "benchmark": "pipeline_bubble",
        "machine": machine(),
        "load_before": load_before,
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "seq_length": SEQ,
        "model": MODEL,
        "steps": args.steps,
        "repeats": args.repeats,
        "results": rows,
    }
    write_json(args.out, report)
    print(json.dumps(report) if args.json else table(report))


if __name__ == "__main__":
    main()
