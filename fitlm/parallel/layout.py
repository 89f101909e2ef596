"""Which parallel layouts are valid, checked before any process group exists.

A layout is (data_parallel, tensor_parallel, pipeline_parallel) plus the ZeRO stage. The rules:
dp × tp × pp = world size; tp divides the head counts, the MLP width and the vocabulary; pp at most
the number of layers; at least pp pipeline micro-batches; and the feature pairs torch cannot compose.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitlm.config import Config

# What each ZeRO stage keeps per data-parallel rank, in the one place the planner reads it from.
# Fractions of the full size: 1 = a full replica on every rank, "1/dp" = sharded over data parallel.
ZERO_STAGES = {
    0: {"params": "1", "grads": "1", "optimizer": "1", "engine": "DDP (all-reduce of gradients)"},
    1: {"params": "1", "grads": "1", "optimizer": "1/dp", "engine": "DDP + ZeroRedundancyOptimizer"},
    2: {"params": "1/dp", "grads": "1/dp", "optimizer": "1/dp",
        "engine": "FSDP2 fully_shard(reshard_after_forward=False): parameters gathered once per step "
                  "and kept through backward"},
    3: {"params": "1/dp", "grads": "1/dp", "optimizer": "1/dp",
        "engine": "FSDP2 fully_shard(reshard_after_forward=True): parameters gathered per block in "
                  "forward and again in backward"},
}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int

    def __str__(self) -> str:
        return f"dp{self.dp}×tp{self.tp}×pp{self.pp}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_problems(cfg: Config, tp: int) -> list[str]:
    from fitlm.parallel.tensor_parallel import tensor_parallel_problems  # rules live beside the code they protect

    return tensor_parallel_problems(cfg.model, tp, sequence_parallel=cfg.parallel.sequence_parallel and tp > 1,
                                    seq_length=cfg.data.seq_length)


def pp_problems(cfg: Config) -> list[str]:
    from fitlm.parallel.pipeline import pipeline_problems  # rules live beside the code they protect

    return pipeline_problems(cfg.model, cfg.parallel, cfg.train.micro_batch_size)


def composition_problems(cfg: Config) -> list[str]:
    """Feature pairs that torch cannot combine (or fitlm does not yet): refused with the alternative."""
    p = cfg.parallel
    out = []
    if p.zero_stage == 1 and (p.tensor_parallel > 1 or p.pipeline_parallel > 1):
        out.append("parallel.zero_stage: 1 (torch's ZeroRedundancyOptimizer) works with plain data parallel only; "
                   "with tensor or pipeline parallel use zero_stage 2 or 3 (FSDP2), which also shard the optimizer")
    if p.sequence_parallel and p.tensor_parallel == 1:
        out.append("parallel.sequence_parallel: shards activations across the tensor-parallel group, which has one "
                   "rank; set tensor_parallel >= 2 or sequence_parallel: false")
    if p.zero_stage and p.data_parallel == 1:
        out.append(f"parallel.zero_stage: {p.zero_stage} shards over data-parallel ranks but data_parallel=1; "
                   "raise data_parallel or set zero_stage: 0")
    return out


def valid_layouts(cfg: Config, world_size: int) -> list[Layout]:
    """Every (dp, tp, pp) with dp·tp·pp = world_size that passes the model-dependent rules."""
    out = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            trial = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={
                "data_parallel": dp, "tensor_parallel": tp, "pipeline_parallel": pp,
                "micro_batch_num": max(cfg.parallel.micro_batch_num, pp)})})
            if not tp_problems(cfg, tp) and not pp_problems(trial):
                out.append(Layout(dp, tp, pp))
    return out


def layout_problems(cfg: Config, world_size: int) -> list[str]:
    """All problems of cfg.parallel for `world_size` processes; each names the key, the arithmetic and the fix."""
    p = cfg.parallel
    out = []
    if p.world_size != world_size:
        layouts = ", ".join(str(x) for x in valid_layouts(cfg, world_size)) or "none for this model"
        out.append(f"parallel: data_parallel × tensor_parallel × pipeline_parallel = {p.data_parallel} × "
                   f"{p.tensor_parallel} × {p.pipeline_parallel} = {p.world_size}, but {world_size} processes run; "
                   f"valid layouts for {world_size}: {layouts}")
    out += tp_problems(cfg, p.tensor_parallel)
    out += pp_problems(cfg)
    out += composition_problems(cfg)
    return out
