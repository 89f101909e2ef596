"""One MoE layer under tensor parallel 2 (CPU, gloo, 2 processes): replicated vs split experts (issue #52).

Not a test: it prints a table (stderr with --json) and writes JSON; it asserts nothing. Two processes
(torch.multiprocessing spawn, gloo, one thread each) run forward + backward of one routed block (fitlm's
MoEFeedForward: fp32 router, top-k, stacked experts on fitlm's grouped-matmul path) under sequence parallel
(each rank holds T/2 of the sequence of the input and of the output gradient) in three ways:

* `replicated` (fitlm today, `WholeOnEveryRank`): all-gather the sequence, run every token through the whole
  experts, keep this rank's slice of the output; backward all-gathers the output gradient and slices the input's.
  The parameters' gradients are the same on both ranks: no reduction.
* `split` (Megatron's expert tensor parallel, a prototype here): each rank holds gate/up rows and down columns of
  its half of I (router replicated); all-gather the sequence, route, run all tokens on the shard, reduce-scatter
  the partial outputs to the sequence slices. Backward: all-gather of the output gradient, reduce-scatter of the
  partial input gradients, all-reduce of the router's (partial) gradient.
* `fitlm`: fitlm's own split (fitlm.parallel.expert_tensor_parallel, `SplitExperts`, what `fitlm train` runs under
  tensor parallel now): the same shards, the router on every token on both ranks, the partial outputs
  reduce-scattered; backward all-gathers the output gradient and all-reduces the partial gradients of the routed
  rows and of their routing weights (the router's own gradient is then whole, no reduction). Its collectives run
  inside DTensor and autograd, so its bytes are the ring counts of those collectives and its seconds in them are
  not measured.
* `local`: each rank routes only its own T/2 tokens through the whole (replicated) experts, no gather; the
  parameters' gradients are then all-reduced over tp, in place (under data parallel that reduction would join
  the dp one, so `comm_s` is its cost when it cannot).

Per contender: per-rank step time (median over the timed steps of interleaved rounds; the slower rank's median
is the step's), time spent inside the collectives, bytes each rank receives per layer and step (ring counts:
all-gather / reduce-scatter (T-1)/T of the full tensor, all-reduce 2(T-1)/T), peak live bytes per rank over one
step (torch's MemTracker, fitlm.memory.tracking; least of 3 steps, as gloo's lag asks), and a check against one
process: this rank's output and input gradient and the parameters' gradients (a split rank: its rows / columns)
against the layer run whole on the full sequence, max |diff| / max |reference| over ranks.

    python bench/moe_tp.py [--sizes narrow wide] [--batch 2] [--seq 512] [--rounds 3] [--steps 2] [--warmup 1]
                           [--json] [--out bench/results/moe_tp.json]
    python bench/moe_tp.py --markdown [bench/results/moe_tp.json]   # the RESULTS.md table
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, emit, log, machine, median  # noqa: E402

TP = 2
# Qwen3-30B-A3B (H 2048, 128 experts, top 8, I 768) scaled down: H / 4, experts / 4, top 8; I 256 and 1024.
SIZES = {
    "narrow": {"hidden": 512, "experts": 32, "top_k": 8, "inner": 256},
    "wide": {"hidden": 512, "experts": 32, "top_k": 8, "inner": 1024},
    "tiny": {"hidden": 64, "experts": 4, "top_k": 2, "inner": 32},
}
CONTENDERS = ("replicated", "split", "fitlm", "local")

# --------------------------------------------------------------------------- collectives, counted


class Comm:
    """The collectives of the contenders on one tp group, each counted: bytes this rank receives, seconds."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.bytes, self.seconds = dist, 0, 0.0

    def _count(self, t0: float, numel: int, share: float) -> None:
        self.seconds += time.perf_counter() - t0
        self.bytes += int(numel * 4 * share)  # fp32

    def gather_seq(self, x):
        """[B, T/TP, H] on each rank -> [B, T, H] (rank order along the sequence)."""
        import torch

        t0 = time.perf_counter()
        out = torch.empty((TP * x.shape[0], *x.shape[1:]), dtype=x.dtype)  # [TP·B, T/TP, H], rank-major
        self.dist.all_gather_into_tensor(out, x.contiguous())
        self._count(t0, out.numel(), (TP - 1) / TP)
        return out.view(TP, *x.shape).movedim(0, 1).reshape(x.shape[0], -1, x.shape[-1])

    def scatter_seq(self, x):
        """[B, T, H] partial sums -> this rank's [B, T/TP, H] of their sum (reduce-scatter)."""
        import torch

        t0 = time.perf_counter()
        b, t, h = x.shape
        parts = x.reshape(b, TP, t // TP, h).movedim(1, 0).reshape(TP * b, t // TP, h)  # rank-major
        out = torch.empty((b, t // TP, h), dtype=x.dtype)
        self.dist.reduce_scatter_tensor(out, parts)
        self._count(t0, parts.numel(), (TP - 1) / TP)
        return out

    def all_reduce(self, flat) -> None:
        t0 = time.perf_counter()
        self.dist.all_reduce(flat)
        self._count(t0, flat.numel(), 2 * (TP - 1) / TP)


def seq_slice(x, rank: int):
    t = x.shape[1] // TP
    return x[:, rank * t : (rank + 1) * t]


def reduce_grads(comm: Comm, params: list) -> None:
    """All-reduce the gradients of `params` in place, one after another (DDP with its buckets as views of the
    gradients: no second copy of them)."""
    for p in params:
        comm.all_reduce(p.grad)


# --------------------------------------------------------------------------- the contenders


def moe_layer(size: dict, inner: int):
    from fitlm.models.moe import MoEFeedForward

    cfg = SimpleNamespace(
        num_experts=size["experts"],
        num_experts_per_tok=size["top_k"],
        hidden_size=size["hidden"],
        expert_ffn_size=inner,
        init_std=0.02,
        capacity_factor=None,
        moe_balance="aux_loss",
    )
    return MoEFeedForward(cfg, normalize=True).train()


def split_layer(whole, size: dict, rank: int):
    """This rank's shard of `whole`: the router whole, gate/up rows and down columns of its I/TP."""
    import torch

    shard = moe_layer(size, size["inner"] // TP)
    cut = slice(rank * size["inner"] // TP, (rank + 1) * size["inner"] // TP)
    with torch.no_grad():
        shard.gate.weight.copy_(whole.gate.weight)
        shard.experts.gate_proj.copy_(whole.experts.gate_proj[:, cut])
        shard.experts.up_proj.copy_(whole.experts.up_proj[:, cut])
        shard.experts.down_proj.copy_(whole.experts.down_proj[:, :, cut])
    return shard, cut


def contenders(size: dict, rank: int, comm: Comm):
    """({name: (module, step(x_r, g_r) -> (y_r, dx_r))}, the split rank's slice of I): one forward + backward of this rank's sequence part x_r
    [B, T/TP, H] with output gradient g_r; the module keeps its parameters' gradients (full-model equivalents)."""
    import torch

    torch.manual_seed(0)
    whole = moe_layer(size, size["inner"])  # the same weights on both ranks (same seed)
    shard, cut = split_layer(whole, size, rank)

    def replicated(x_r, g_r):
        x = comm.gather_seq(x_r).requires_grad_()
        y = whole(x)
        y.backward(comm.gather_seq(g_r))  # the slice's gradient, gathered (WholeOnEveryRank's backward)
        return seq_slice(y, rank).detach(), seq_slice(x.grad, rank)

    def split(x_r, g_r):
        x = comm.gather_seq(x_r).requires_grad_()
        part = shard(x)  # [B, T, H]: this rank's I/TP share of every token's experts, routing weights applied
        y_r = comm.scatter_seq(part.detach())
        part.backward(comm.gather_seq(g_r))  # the reduce-scatter's backward: the gradient gathered
        comm.all_reduce(shard.gate.weight.grad)  # partial: the routing weights' gradient is per shard
        return y_r, comm.scatter_seq(x.grad)  # the input gradient: sum of the shards', this rank's slice

    fitlm_layer = fitlm_split_layer(whole, size)

    def fitlm(x_r, g_r):
        x = x_r.detach().requires_grad_()
        y = fitlm_layer(x)  # [B, T/TP, H]: SplitExperts gathers, routes, runs the shards, reduce-scatters
        y.backward(g_r)
        return y.detach(), x.grad

    def local(x_r, g_r):
        x = x_r.detach().requires_grad_()
        y = whole(x)
        y.backward(g_r)
        reduce_grads(comm, list(whole.parameters()))  # each rank's gradient covers its tokens only
        return y.detach(), x.grad

    runs = {"replicated": (whole, replicated), "split": (shard, split), "fitlm": (fitlm_layer, fitlm)}
    return {**runs, "local": (whole, local)}, cut


def fitlm_split_layer(whole, size: dict):
    """`whole`'s weights in a layer split by fitlm's own tensor-parallel style over the 2 ranks, under sequence
    parallel (its input and output the rank's part of the sequence)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fitlm.parallel.expert_tensor_parallel import SplitExperts

    layer = moe_layer(size, size["inner"])
    layer.load_state_dict(whole.state_dict())
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    return SplitExperts(Shard(1))._apply(layer, mesh)


def fitlm_bytes(size: dict, tokens: int) -> int:
    """Bytes a rank receives per layer and step in fitlm's split (ring counts, fp32): the input's all-gather, the
    output's reduce-scatter, the output gradient's all-gather ((TP-1)/TP of [N, H] each), the all-reduces of the
    routed rows' [N, H] and routing weights' [N, k] gradients (2(TP-1)/TP each)."""
    full, weights = tokens * size["hidden"], tokens * size["top_k"]
    return int(4 * (3 * full * (TP - 1) / TP + 2 * (full + weights) * (TP - 1) / TP))


# --------------------------------------------------------------------------- one rank


def check(size: dict, rank: int, x, g, runs: dict, shard_cut) -> dict[str, float]:
    """Max |diff| / max |reference| of each contender's output, input gradient and parameter gradients
    against the layer run whole on the full batch in this process."""
    import torch

    torch.manual_seed(0)
    ref = moe_layer(size, size["inner"])
    xx = x.detach().requires_grad_()
    y = ref(xx)
    y.backward(g)
    y = y.detach()
    out = {}
    for name, (module, step) in runs.items():
        module.zero_grad(set_to_none=True)
        y_r, dx_r = step(seq_slice(x, rank), seq_slice(g, rank))
        pairs = [(y_r, seq_slice(y, rank)), (dx_r, seq_slice(xx.grad, rank))]
        for (pname, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
            want = q.grad
            if name in ("split", "fitlm") and pname.startswith("experts."):
                want = want[:, :, shard_cut] if pname.endswith("down_proj") else want[:, shard_cut]
            pairs.append((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, want))
        out[name] = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
        module.zero_grad(set_to_none=True)
    return out


def timed_rounds(calls: dict, args, comm: Comm) -> tuple[dict, dict, dict]:
    """Step seconds and seconds in collectives per contender (after the warm-up of each round), bytes received."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {n: [] for n in calls}
    comm_s: dict[str, list[float]] = {n: [] for n in calls}
    sent: dict[str, int] = {}
    for _round in range(args.rounds):
        for name, call in calls.items():  # interleaved: a burst of another job slows all alike
            for i in range(args.warmup + args.steps):
                dist.barrier()
                comm.bytes, comm.seconds = 0, 0.0
                t0 = time.perf_counter()
                call()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                    comm_s[name].append(comm.seconds)
                sent[name] = comm.bytes
    return times, comm_s, sent


def step_call(module, step, x_r, g_r):
    def run():
        step(x_r, g_r)
        module.zero_grad(set_to_none=True)

    return run


def measure(size_name: str, args, rank: int) -> list[dict]:
    """This rank's row of every contender at one size."""
    import torch
    import torch.distributed as dist

    from fitlm.memory.tracking import track_step

    size = SIZES[size_name]
    comm = Comm()
    runs, cut = contenders(size, rank, comm)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, size["hidden"], generator=gen)  # [B, T, H], the same on both ranks
    g = torch.randn(x.shape, generator=gen)
    diffs = check(size, rank, x, g, runs, cut)
    x_r, g_r = seq_slice(x, rank).contiguous(), seq_slice(g, rank).contiguous()
    calls = {name: step_call(module, step, x_r, g_r) for name, (module, step) in runs.items()}
    times, comm_s, sent = timed_rounds(calls, args, comm)
    sent["fitlm"] = fitlm_bytes(size, args.batch * args.seq)  # (its collectives are DTensor's and autograd's)
    comm_s["fitlm"] = []  # not measured
    peaks = {}
    for name, call in calls.items():
        dist.barrier()
        peaks[name] = track_step(call, [runs[name][0]], None, warmup_steps=1, measured_steps=3).peak["total"]
    log(f"  rank {rank} {size_name}: " + ", ".join(f"{n} {median(times[n]):.3f}s" for n in CONTENDERS))
    return [
        {
            "size": size_name,
            **size,
            "contender": name,
            "rank": rank,
            "step_s": median(times[name]),
            "comm_s": median(comm_s[name]) if comm_s[name] else None,
            "comm_bytes": sent[name],
            "peak_bytes": peaks[name],
            "param_bytes": sum(_local(p).numel() * 4 for p in runs[name][0].parameters()),
            "max_rel_diff": diffs[name],
            "step_s_all": [round(t, 4) for t in times[name]],
        }
        for name in CONTENDERS
    ]


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def rank_main(rank: int, args, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's *_into_tensor names
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=TP)
    rows = [row for size_name in args.sizes for row in measure(size_name, args, rank)]
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the report


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (size, contender): the slower rank's step and communication time, the larger peak, the worst
    check; `vs_replicated` = its step time / the replicated one's (< 1: faster than fitlm today)."""
    out = []
    for rows in zip(*per_rank):
        r = {k: v for k, v in rows[0].items() if k not in ("rank", "step_s_all")}
        r["step_s_ranks"] = [round(x["step_s"], 4) for x in rows]
        r["step_s"] = round(max(x["step_s"] for x in rows), 4)
        r["comm_s"] = None if rows[0]["comm_s"] is None else round(max(x["comm_s"] for x in rows), 4)
        r["peak_bytes"] = max(x["peak_bytes"] for x in rows)
        r["max_rel_diff"] = max(x["max_rel_diff"] for x in rows)
        r["step_s_all"] = [x["step_s_all"] for x in rows]
        out.append(r)
    for r in out:
        base = next(x for x in out if x["size"] == r["size"] and x["contender"] == "replicated")
        r["vs_replicated"] = round(r["step_s"] / base["step_s"], 3)
    return out


def table(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"- Machine: {m.get('cpus')} CPUs (shared with other jobs), load average at the end "
        f"{m.get('load_avg_1m', '?')}; Python {m.get('python')}, torch {m.get('torch')}; {TP} processes, gloo, "
        "one thread each",
        f"- Command: `{report['command']}`",
        f"- Tokens {report['batch']} × {report['seq']} (each rank holds {report['seq'] // TP} of the sequence), "
        f"fp32; median of {report['steps']} steps × {report['rounds']} interleaved rounds after {report['warmup']} "
        "warm-up step(s) per round; the slower rank's median",
        "",
        "| size (H, E, k, I) | contender | step s | vs replicated | in collectives s | MiB received / rank | "
        "peak MiB / rank | param MiB / rank | max rel diff vs 1 process |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        shape = f"{r['size']} ({r['hidden']}, {r['experts']}, {r['top_k']}, {r['inner']})"
        lines.append(
            f"| {shape} | {r['contender']} | {r['step_s']:.3f} | {r['vs_replicated']:.2f} | "
            f"{'–' if r['comm_s'] is None else format(r['comm_s'], '.3f')} | "
            f"{r['comm_bytes'] / 2**20:.2f} | {r['peak_bytes'] / 2**20:.1f} | {r['param_bytes'] / 2**20:.1f} | "
            f"{r['max_rel_diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["narrow", "wide"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", nargs="?", const=str(RESULTS / "moe_tp.json"), default=None)
    args = ap.parse_args()
    if args.markdown:
        print(table(json.loads(Path(args.markdown).read_text())))
        return
    if args.seq % TP:
        sys.exit(f"--seq {args.seq}: must be a multiple of {TP} (each tp rank holds seq / {TP} tokens)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args, tmp), nprocs=TP)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(TP)]
    report = {
        "benchmark": "moe_tp",
        "machine": machine(),
        "command": "python bench/moe_tp.py " + " ".join(sys.argv[1:]),
        "tp": TP,
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": merge(per_rank),
    }
    emit(report, table, Path(args.out) if args.out else None, args.json)


if __name__ == "__main__":
    main()
