"""Step time, tokens/s and MFU of a layout on a device: compute, communication, pipeline bubble.

Why these terms: they are the ones a layout choice moves. Compute is FLOPs per token (6·N, N the parameters
in a matmul per token, of an MoE layer's E experts the k a token is routed to, plus
attention 12·L·h·s, counted in full as fitlm.models.flops does for the trainer) over the device's peak times its
efficiency; full recompute adds one more forward of the blocks (hardware FLOPs, not model FLOPs).
Frozen weights (LoRA, freeze) skip their weight gradients, so their model FLOPs are 4 per parameter.
DPO trains on both rows of every pair (tokens per step count 2 rows per pair) and runs one more, no-grad
forward of the reference per micro batch (2 per matmul parameter plus 4·L·h·s per token: a third more).
GRPO's old and reference forwards count the same way, once per generation batch; its sampling is fitlm.plan.grpo's
`grpo_sampling`.
LoRA under tensor parallel leaves the gradients of the replicated adapter halves Partial; the optimizer step
all-reduces them each time it reads them (fitlm.plan.finetune.lora_partial_gradients), once per step.
Communication uses ring costs (all-reduce 2(n-1)/n·S/B, all-gather and reduce-scatter (n-1)/n·S/B)
on the intra-node link when a group fits in a node, else the network; a latency of 10 µs per call.
Tensor-parallel collectives sit on the critical path; data-parallel gradient traffic overlaps with
the backward pass (half of it hidden at most). The pipeline bubble is (p-1)/(n+p-1) of the step, n =
micro_batch_num × accumulation: one schedule run takes all of a step's chunks (halved by interleaving
with 2 virtual stages). Context parallel: each rank computes T/C tokens of every sequence; its K/V
all-gathers and reduce-scatters per layer (fitlm.plan.context_parallel) are on the critical path. Activation offload's
copies over the host link overlap their pass's compute (fitlm.plan.activation_offload).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitlm.plan import finetune as ft
from fitlm.plan.analytic import act_bytes, breakdown, param_bytes
from fitlm.plan.devices import Device
from fitlm.plan.features import FEATURES
from fitlm.plan.setup import Setup, active_block_params, matmul_params, stage_layers, total_params
from fitlm.plan.terms import TimeContext

LATENCY_S = 10e-6


@dataclass(frozen=True)
class Timing:
    step_s: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    tokens_per_s: float
    mfu: float
    flops_per_token: float
    # The features' seconds on the critical path, by report key (fitlm.plan.features): context parallel's K/V
    # gathers, activation offload's exposed copies, expert parallel's all-to-alls...
    features: tuple[tuple[str, float], ...] = ()

    def feature_s(self, key: str) -> float:
        return dict(self.features).get(key, 0.0)

    @property
    def cp_comm_s(self) -> float:
        return self.feature_s("context_parallel_comm")

    @property
    def offload_s(self) -> float:
        return self.feature_s("activation_offload_copies")

    @property
    def ep_comm_s(self) -> float:
        return self.feature_s("expert_parallel_all_to_all")


def flops_per_token(s: Setup) -> float:
    """6 FLOPs per matmul parameter plus attention; a frozen weight (LoRA, freeze) needs no weight
    gradient (4 instead of 6), and LoRA's adapters add their own 6 per parameter."""
    fpt = 6.0 * matmul_params(s) + 12.0 * s.layers * s.h * s.seq
    if s.method != "full":
        fpt -= 2.0 * max(0, matmul_params(s) - ft.trainable_params(s)) - 6.0 * ft.adapter_params(s)
    return fpt


def _trained_rank(s: Setup) -> float:
    """Trainable parameters on the most loaded rank (tensor-split; freeze trains the last stage most)."""
    return max(ft.stage_trainable(s, first) for first in ((True, False) if s.pp > 1 else (True,)))


def _bandwidth(dev: Device, group: int, stride: int) -> float:
    """Bytes/s for a ring over `group` ranks spaced `stride` apart in the (pp, dp, cp, tp) mesh."""
    inside = group * stride <= dev.node_size
    return (dev.link_gbs if inside else dev.inter_node_gbs) * 1e9


def ring(kind: str, size: float, n: int, bw: float) -> float:
    if n <= 1 or size <= 0:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (n - 1) / n * size / bw + LATENCY_S * (n - 1)


def timing(s: Setup, dev: Device) -> Timing:
    fpt = flops_per_token(s)
    compute = _compute_s(s, dev, fpt)
    # Tensor parallel: two all-reduces (or all-gather + reduce-scatter under SP) per block forward and
    # two in backward, of the block's activations [b, s, h]; plus the embedding's.
    e = act_bytes(s)
    msg = s.rows * s.local_seq * s.h * e  # this rank's tokens: T/C under context parallel
    bw_tp = _bandwidth(dev, s.tp, 1)
    per_mb_layers = stage_layers(s)
    tp_comm = s.accum * (4 * per_mb_layers + 2) * ring("all_reduce", msg, s.tp, bw_tp)
    adapter_grads = per_mb_layers * ft.lora_partial_gradients(s) * param_bytes(s)  # per step, not per micro batch
    tp_comm += ft.PARTIAL_READS_PER_STEP * ring("all_reduce", adapter_grads, s.tp, bw_tp)
    links = lambda n, stride: _bandwidth(dev, n, stride)  # noqa: E731
    tc = TimeContext(s, dev, compute, lambda: breakdown(s), ring, links, LATENCY_S)
    timed = [f.time(tc) for f in FEATURES]
    critical = tuple((k, v) for t in timed for k, v in t.critical.items())
    dp_comm = _dp_comm_s(s, dev) + sum(t.overlapped for t in timed)
    backward = compute * 2.0 / 3.0
    dp_exposed = max(dp_comm - 0.5 * backward, 0.5 * dp_comm) if s.dims.dp_cp > 1 else 0.0
    # Pipeline: each chunk's activations cross each boundary forward and their gradients backward.
    bw_pp = _bandwidth(dev, s.pp, s.dims.dp_cp * s.tp)
    chunks = max(1, s.chunks) if s.pp > 1 else 1
    pp_comm = s.accum * 2 * chunks * (msg / chunks / bw_pp + LATENCY_S) if s.pp > 1 else 0.0
    bubble_frac = (s.pp - 1) / (s.step_chunks + s.pp - 1) if s.pp > 1 else 0.0
    if s.schedule == "interleaved_1f1b":
        bubble_frac /= 2
    busy = compute + tp_comm + pp_comm + sum(v for _, v in critical)
    bubble = busy * bubble_frac / (1 - bubble_frac) if bubble_frac < 1 else 0.0
    step = busy + bubble + dp_exposed
    tokens = s.tokens_per_step / step
    mfu = tokens * fpt / (s.world * dev.tflops * 1e12)
    return Timing(step, compute, tp_comm, dp_exposed, pp_comm, bubble, tokens, mfu, fpt, critical)


def _compute_s(s: Setup, dev: Device, fpt: float) -> float:
    """Seconds of compute per step on one rank: model FLOPs plus DPO's reference forward and recompute's reruns,
    at the device's peak times its efficiency; host AdamW's transfers and update under cpu_offload."""
    tokens_replica = s.rows * s.seq * s.accum  # per data-parallel replica per step (DPO: both rows of a pair)
    peak = dev.tflops * 1e12 * dev.efficiency
    hw = fpt + ft.reference_forward_flops(s, matmul_params(s))  # DPO's/GRPO's no-grad forwards: work, not model FLOPs
    if s.recompute != "none":
        frac = 1.0 / max(1, s.recompute_every)
        block_fwd = 2.0 * s.layers * active_block_params(s) + 4.0 * s.layers * s.h * s.seq
        hw += frac * block_fwd * (1.0 if s.recompute == "full" else 0.1)  # selective reruns element-wise work
    compute = tokens_replica * hw / (s.tp * s.pp * s.cp) / peak
    if s.offload:  # host AdamW: gradients down, parameters up over PCIe (~25 GB/s), states on the CPU
        n_dev = _trained_rank(s) / s.dims.shard_factor("optimizer")
        compute += n_dev * (4 + 4) / 25e9 + n_dev * 16 / (100e9)
    return compute


def _dp_comm_s(s: Setup, dev: Device) -> float:
    """Data parallel's traffic per step: gradients once per step, or once per micro batch (parallel.gradient_sync;
    ZeRO-2/3 by default), parameters as ZeRO needs; of the parameters the engine counts (a feature's own, such as
    expert parallel's experts, are reduced by that feature)."""
    owned = sum(o.dense for f in FEATURES if (o := f.owned(s, True)) is not None)
    n_rank = (total_params(s) - owned) / (s.tp * s.pp)
    dp = s.dims.dp_cp  # gradients are averaged (and ZeRO shards) over data x context parallel ranks
    bw_dp = _bandwidth(dev, dp, s.tp)
    trained_rank = n_rank if s.method == "full" else _trained_rank(s)
    grad_b = trained_rank * (4 if s.level == "O2" else param_bytes(s))  # only trainable parameters have gradients
    gather_b = n_rank * (2 if s.level == "O2" else param_bytes(s))
    syncs = s.accum if s.sync_every else 1
    if s.zero <= 1:
        return syncs * ring("all_reduce", grad_b, dp, bw_dp) + (
            ring("all_gather", gather_b, dp, bw_dp) if s.zero == 1 else 0
        )
    gathers = s.accum * (1 if s.zero == 2 else 2)
    return syncs * ring("reduce_scatter", grad_b, dp, bw_dp) + gathers * ring("all_gather", gather_b, dp, bw_dp)
