"""The parallel layout's dimensions and every predicate derived from them, written once.

In the manner of torchtitan's ParallelDims: code asks `dims.fsdp_sharded` or `dims.replicated`
instead of re-deriving "zero_stage >= 2 and dp > 1" where it needs it. Imports nothing from fitlm, so
the config, the planner and the parallel package can all stand on it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Mesh dimensions, outermost to innermost: tensor-parallel ranks are adjacent (same node, fastest links),
# then context-parallel ranks (a key/value all-gather per layer), pipeline stages are furthest apart.
MESH_DIMS = ("pp", "dp", "cp", "tp")
# The flattened dp x cp dimension (made only when cp > 1): the ranks that split the global batch's tokens
# between them, so they sum losses and target counts and average gradients; FSDP2 shards over it.
DP_CP = "dp_cp"
# The name reductions use for every rank of the job, beside the mesh dimensions.
WORLD = "world"
# Under expert parallel the data-parallel ranks are carved in two: "ep", the ranks one MoE layer's experts are
# split over (adjacent, like tensor parallel: an all-to-all per MoE layer), and "edp", the replicas of one expert
# shard; "dp" is then the flattened edp x ep dimension.
EXPERT_DIMS = ("edp", "ep")
# Under expert and context parallel, the ranks that hold the same expert shard: its data-parallel replicas (edp)
# times the context-parallel ranks (each routes its part of every sequence through the same experts).
EDP_CP = "edp_cp"


# What each ZeRO stage keeps per data-parallel rank at rest, in the one place the planner reads it from
# (ParallelDims.shard_factor); tests/distributed/test_zero_stages.py measures it on the engines.
# Fractions of the full size: 1 = a full replica on every rank, "1/dp" = sharded over data parallel
# (over data_parallel x context_parallel ranks when context parallel splits sequences too).
ZERO_STAGES = {
    0: {"params": "1", "grads": "1", "optimizer": "1", "engine": "DDP (all-reduce of gradients)"},
    1: {"params": "1", "grads": "1", "optimizer": "1/dp", "engine": "DDP + ZeroRedundancyOptimizer"},
    2: {
        "params": "1/dp",
        "grads": "1/dp",
        "optimizer": "1/dp",
        "engine": "FSDP2 fully_shard(reshard_after_forward=False): parameters gathered once per step "
        "and kept through backward",
    },
    3: {
        "params": "1/dp",
        "grads": "1/dp",
        "optimizer": "1/dp",
        "engine": "FSDP2 fully_shard(reshard_after_forward=True): parameters gathered per block in "
        "forward and again in backward",
    },
}


def divisors(n: int) -> list[int]:
    """The whole numbers that divide n, ascending: the degrees a dimension of size n can be split into."""
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_name(dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> str:
    """The one spelling of a layout in reports, logs and checkpoints: dp2×tp2×pp1 (×cp2 when context parallel,
    ×ep2 when expert parallel, whose ranks are carved out of dp)."""
    return f"dp{dp}×tp{tp}×pp{pp}" + (f"×cp{cp}" if cp > 1 else "") + (f"×ep{ep}" if ep > 1 else "")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    cp: int = 1
    ep: int = 1  # expert parallel: ranks taken from dp (ep divides dp), so not a factor of the world size

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes in `mesh_names` order."""
        if self.ep > 1:
            return (self.pp, self.edp, self.ep, self.cp, self.tp)
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        """The dimensions the mesh is built with: MESH_DIMS, with "dp" built as edp x ep under expert parallel
        (then flattened back into "dp", so every other feature finds the data-parallel group it knows)."""
        return ("pp", *EXPERT_DIMS, "cp", "tp") if self.ep > 1 else MESH_DIMS

    @property
    def edp(self) -> int:
        """Ranks that hold the same expert shard (the data-parallel replicas of one expert-parallel group):
        expert gradients are summed over these, and divided by dp like every other gradient."""
        return self.dp // self.ep

    @property
    def expert_replicas(self) -> int:
        """Ranks that hold the same expert shard and route other tokens through it (edp x cp): expert gradients
        are summed over these and divided by dp x cp, the divisor of every other gradient."""
        return self.edp * self.cp

    @property
    def expert_replica_dim(self) -> str:
        """The mesh dimension of those ranks: "edp", or the flattened "edp_cp" under context parallel."""
        return EDP_CP if self.cp > 1 else "edp"

    @property
    def name(self) -> str:
        return layout_name(self.dp, self.tp, self.pp, self.cp, self.ep)

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters (or ZeRO shards of them) and split the batch's tokens: data
        parallel replicas times the context-parallel ranks each sequence is split over. Gradients are
        averaged, and ZeRO shards, over these."""
        return self.dp * self.cp

    @property
    def token_dim(self) -> str:
        """The mesh dimension of those ranks: "dp", or the flattened "dp_cp" under context parallel."""
        return DP_CP if self.cp > 1 else "dp"

    @property
    def fsdp_sharded(self) -> bool:
        """ZeRO-2/3 over more than one data-parallel (x context-parallel) rank: FSDP2 shards gradients (and,
        at 3, parameters), owns the O2 casting policy and the host offload of its shards."""
        return self.zero_stage >= 2 and self.dp_cp > 1

    @property
    def param_shards(self) -> int:
        """Row shards each stored parameter is split into: FSDP2 (ZeRO-2/3) shards dim 0 over the dp_cp ranks."""
        return self.dp_cp if self.fsdp_sharded else 1

    @property
    def expert_param_shards(self) -> int:
        """Row shards each stacked expert weight is split into: `param_shards` without expert parallel; under it
        the ep ranks' E/ep experts each, and FSDP2 (ZeRO-2/3) splits those once more over their edp replicas
        (fitlm.parallel.expert_parallel)."""
        if self.ep == 1:
            return self.param_shards
        return self.ep * (self.edp if self.fsdp_sharded else 1)

    @property
    def zero1(self) -> bool:
        """ZeRO-1: torch's ZeroRedundancyOptimizer shards optimizer states over the data-parallel group."""
        return self.zero_stage == 1 and self.dp_cp > 1

    @property
    def replicated(self) -> bool:
        """Data-parallel (or context-parallel) ranks hold whole, identical parameters (DDP, ZeRO 0/1)."""
        return self.dp_cp > 1 and self.zero_stage <= 1

    @property
    def ddp(self) -> bool:
        """Gradients are averaged by torch's DistributedDataParallel (replicas without tensor or expert
        parallel: DDP takes no DTensor parameters)."""
        return self.replicated and self.tp == 1 and self.ep == 1

    def shard_factor(self, component: str) -> int:
        """How many ways `component` (params, grads or optimizer) is split over data-parallel ranks at rest."""
        return self.dp_cp if ZERO_STAGES[self.zero_stage][component] == "1/dp" else 1

    def expert_shard_factor(self, component: str) -> int:
        """How many ways expert parallel's experts' `component` is split over their replicas (edp) at rest: FSDP2
        shards them over edp under ZeRO-2/3 as it shards the dense model over dp (fitlm.parallel.expert_parallel)."""
        if self.ep == 1 or not self.fsdp_sharded:
            return 1
        return self.edp if ZERO_STAGES[self.zero_stage][component] == "1/dp" else 1

    def reduce_every_micro_batch(self, gradient_sync: str) -> bool:
        """parallel.gradient_sync resolved: `auto` reduces every micro batch exactly when ZeRO-2/3 shard
        gradients (they keep only their shard between micro batches); otherwise as the key says. Under
        pipeline parallel never: all micro batches of a step share one schedule run, which reduces once,
        after its last backward (torch's PipelineStage drives FSDP2's sync itself)."""
        if self.pp > 1:
            return False
        if gradient_sync == "auto":
            return self.fsdp_sharded
        return gradient_sync == "every_micro_batch"
