"""Which parallel layouts are valid, checked before any process group exists.

A layout is (data_parallel, tensor_parallel, pipeline_parallel) plus the ZeRO stage. The rules:
dp × tp × pp = world size; tp divides the head counts, the MLP width and the vocabulary; pp at most
the number of layers; at least pp pipeline chunks per step (micro_batch_num × gradient accumulation).
Which features compose with which is fitlm.rules' table, checked with the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitlm.config import Config
from fitlm.parallel_dims import divisors

@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int

    def __str__(self) -> str:
        return f"dp{self.dp}×tp{self.tp}×pp{self.pp}"


def tp_problems(cfg: Config, tp: int) -> list[str]:
    from fitlm.parallel.tensor_parallel import tensor_parallel_problems  # rules live beside the code they protect

    return tensor_parallel_problems(cfg.model, tp, sequence_parallel=cfg.parallel.sequence_parallel and tp > 1,
                                    seq_length=cfg.data.seq_length)


def pp_problems(cfg: Config) -> list[str]:
    from fitlm.parallel.pipeline import pipeline_problems  # rules live beside the code they protect

    t = cfg.train
    return pipeline_problems(cfg.model, cfg.parallel, t.micro_batch_size, t.gradient_accumulation_steps)


def valid_layouts(cfg: Config, world_size: int) -> list[Layout]:
    """Every (dp, tp, pp) with dp·tp·pp = world_size that passes the model-dependent rules."""
    out = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
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
    return out
