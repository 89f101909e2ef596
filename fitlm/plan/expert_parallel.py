"""Expert parallel's planner terms (parallel.expert_parallel = ep > 1), as fitlm.parallel.expert_parallel runs it.

- Each rank holds E/ep of every MoE block's stacked experts (3 matrices of E·I × H: `experts.*` in the family's
  block counts). Under ZeRO-2/3 with replicas of the same experts (edp = dp/ep > 1) FSDP2 shards them again over
  those edp ranks, as it shards the dense model over dp (`ParallelDims.expert_shard_factor`); otherwise each rank
  keeps its experts whole (ZeRO 0 and 1, or edp 1) and sums their gradients over edp. So their parameters,
  gradients and optimizer states are counted on the E/ep a rank holds, sharded over edp as the ZeRO stage shards
  the rest; the rest of the model is counted as before.
- The dispatch keeps one MoE layer's send and receive buffers of the routed rows (tokens × top-k × H) while
  the layer runs: an `other` part.
- Each MoE layer runs four all-to-alls of those rows per micro batch (dispatch and combine, forward and
  backward); a rank keeps 1/ep of them and sends the rest over the link.

Tensor parallel splits each expert on its width (fitlm.parallel.expert_tensor_parallel): a rank holds 1/tp of
each of its experts, and each routed block all-reduces its input gradient over tp once more (`split_experts_seconds`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from fitlm.parallel_dims import divisors
from fitlm.plan.finetune import lora_targets, nf4_split, stage_expert_adapters
from fitlm.plan.setup import Setup, act_bytes, param_bytes, stage_routed
from fitlm.plan.terms import Axis, Feature, Owned, Stage, Term, TimeContext, Timed

if TYPE_CHECKING:
    from fitlm.config import Config
    from fitlm.parallel.layout import Layout

A2A_BUFFERS = "expert-parallel all-to-all buffers"


def stage_expert_params(s: Setup, first: bool = True) -> int:
    """Parameters of all experts of the routed blocks a rank's stage holds (the first, most loaded, or the last;
    before expert parallel splits them)."""
    per_block = sum(i * o for name, i, o in s.counts.linears if name.startswith("experts."))
    return stage_routed(s, first) * per_block


def experts_per_device(s: Setup) -> int:
    """Routed experts a device holds at most, over the routed blocks of its pipeline stage (the first or the last,
    whichever holds more of them: a dense block among them may sit on either), E/ep of each; 0 for a dense model."""
    e = s.cfg.model.num_experts or 0
    return max(stage_routed(s, True), stage_routed(s, False)) * e // s.ep


def local_expert_params(s: Setup, first: bool = True) -> float:
    """The experts a rank holds: E/ep of every MoE block's of its stage, each 1/tp of its width (tensor parallel
    splits inside each expert: fitlm.parallel.expert_tensor_parallel)."""
    return stage_expert_params(s, first) / (s.ep * s.tp)


def routed_rows(s: Setup, tokens: float) -> float:
    """Rows one MoE layer dispatches for `tokens` tokens: each goes to its top-k experts."""
    return tokens * s.cfg.model.num_experts_per_tok


def alltoall_buffers(s: Setup, tokens: float, act_bytes: int) -> float:
    """One layer's send and receive buffers of the routed rows (H wide, in the activation dtype): N·k sent, and
    received `Setup.imbalance` times that (balanced: as many as sent; fitlm.plan.routing's worst case: more)."""
    return (1 + s.imbalance) * routed_rows(s, tokens) * s.h * act_bytes if s.ep > 1 else 0.0


def alltoall_seconds(
    s: Setup, tokens_per_micro_batch: float, act_bytes: int, bandwidth: float, latency_s: float
) -> float:
    """A step's all-to-all time: 4 per MoE layer of the busier pipeline stage (its routed blocks: a dense block
    runs none) per micro batch, each moving the (ep-1)/ep of the routed rows that leave the rank at `bandwidth`
    (bytes/s) after `latency_s` per peer."""
    if s.ep == 1:
        return 0.0
    leaving = routed_rows(s, tokens_per_micro_batch) * s.h * act_bytes * (s.ep - 1) / s.ep
    layers = max(stage_routed(s, True), stage_routed(s, False))
    return 4 * layers * s.accum * (leaving / bandwidth + latency_s * (s.ep - 1))


def owned(s: Setup, first: bool) -> Owned | None:
    """A rank's experts, counted apart from the dense model: E/ep of every block's, 1/tp of each one's width,
    whole or sharded over edp (see the module docstring). Trained under full fine-tuning, frozen under LoRA (the
    adapters of a rank's E/ep experts are counted with them), trained above the frozen bottom under freeze;
    QLoRA's 4-bit experts by their bytes (fitlm.plan.finetune.nf4_split). Without expert parallel the engine's
    own count holds: tensor parallel splits the experts as it splits every other weight
    (fitlm.parallel.expert_tensor_parallel)."""
    if s.ep == 1:
        return None
    experts, local = stage_expert_params(s, first), local_expert_params(s, first)
    trained = {"full": local, "freeze": local * (1 - s.freeze_layers)}.get(s.method, 0.0)
    counted = experts / s.tp  # what the engine's tp share holds of them (fitlm.plan.analytic.tp_share)
    # counted as a data-parallel group of edp ranks that the ZeRO stage shards, or at ZeRO 0 when it does not;
    # LoRA's and QLoRA's expert adapters with them (the engine's count has them in its trainable ones)
    sharded = s.dims.expert_shard_factor("optimizer") > 1
    as_setup = replace(s, dp=s.dims.edp, ep=1, cp=1) if sharded else replace(s, zero=0)
    adapters = stage_expert_adapters(s, first)
    dense_trained = counted if s.method == "full" else adapters
    # QLoRA's 4-bit experts: this rank's E/ep experts' codes, split over edp as FSDP2 splits them
    nf4 = nf4_split(s, experts=True)
    return Owned(counted + adapters, dense_trained, local + adapters, trained + adapters, as_setup, nf4)


def memory(st: Stage) -> list[Term]:
    return [Term("other", A2A_BUFFERS, alltoall_buffers(st.s, st.tokens, act_bytes(st.s)))] if st.s.ep > 1 else []


def time(tc: TimeContext) -> Timed:
    """The all-to-alls on the critical path (the experts wait for their rows), and the experts' gradients
    reduced over the ranks that hold the same ones (edp), overlapping backward as data parallel's do: all-reduced,
    or reduce-scattered with the parameters all-gathered as ZeRO-2/3 gathers the rest when FSDP2 shards them."""
    s = tc.s
    a2a = alltoall_seconds(s, s.rows * s.local_seq, act_bytes(s), tc.bandwidth(s.ep, s.tp), tc.latency_s)
    split = split_experts_seconds(tc)
    if s.ep == 1:
        return Timed({"expert_parallel_all_to_all": a2a, **split})
    grads = local_expert_params(s) * param_bytes(s) if s.method == "full" else 0.0
    syncs = s.accum if s.sync_every else 1
    bandwidth = tc.bandwidth(s.dims.dp_cp, s.tp)
    if s.dims.expert_shard_factor("optimizer") == 1:
        reduced = syncs * tc.ring("all_reduce", grads, s.dims.expert_replicas, bandwidth)
        return Timed({"expert_parallel_all_to_all": a2a}, reduced)
    gathered = local_expert_params(s) * act_bytes(s)  # gathered in the compute dtype (O2's half all-gather)
    gathers = s.accum * (1 if s.zero == 2 else 2)
    reduced = syncs * tc.ring("reduce_scatter", grads, s.dims.edp, bandwidth)
    return Timed(
        {"expert_parallel_all_to_all": a2a, **split},
        reduced + gathers * tc.ring("all_gather", gathered, s.dims.edp, bandwidth),
    )


def split_experts_seconds(tc: TimeContext) -> dict[str, float]:
    """What splitting the experts over tensor parallel adds to the block's usual two all-reduces a sub-block (the
    reduce of the experts' partial output replaces the slice of a whole one's): per routed block and micro batch, the
    all-reduce of the routed rows' input gradient [N, H] (the routing weights' [N, k] beside it is small); per step,
    the all-reduce of the replicated expert adapter factors' gradients (fitlm.parallel.expert_tensor_parallel)."""
    s = tc.s
    routed = max(stage_routed(s, True), stage_routed(s, False))
    if s.tp == 1 or not routed:
        return {}
    bandwidth = tc.bandwidth(s.tp, 1)
    rows = s.rows * s.local_seq * s.h * act_bytes(s)  # the tp group's tokens, every rank's full copy
    # the replicated factors: A [r, H] of gate/up, B [H, r] of down, of each of the rank's E/ep experts
    factors = sum(1 for n in lora_targets(s) if n in ("experts.gate_proj", "experts.up_proj", "experts.down_proj"))
    grads = routed * factors * s.h * s.lora_r * (s.cfg.model.num_experts or 0) / s.ep * param_bytes(s)
    per_micro_batch = routed * tc.ring("all_reduce", rows, s.tp, bandwidth)
    return {"split_experts_comm": s.accum * per_micro_batch + tc.ring("all_reduce", grads, s.tp, bandwidth)}


def axis(cfg: "Config", lay: "Layout") -> Axis | None:
    """plan --search tries every degree dividing both data_parallel and the experts (MoE only)."""
    e = cfg.model.num_experts
    return Axis("ep", [d for d in divisors(lay.dp) if e % d == 0]) if e else None


FEATURE = Feature("expert parallel", memory=memory, owned=owned, time=time, axis=axis)

__all__ = [
    "A2A_BUFFERS",
    "alltoall_buffers",
    "alltoall_seconds",
    "owned",
    "local_expert_params",
    "stage_expert_params",
    "experts_per_device",
]
