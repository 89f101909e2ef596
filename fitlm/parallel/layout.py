"""Which parallel layouts are valid, checked before any process group exists.

A layout is (data_parallel, tensor_parallel, pipeline_parallel, context_parallel) plus the ZeRO stage. The
rules: dp × cp × tp × pp = world size; cp splits data.seq_length into 2·cp equal chunks; tp divides the head counts,
the MLP width and the vocabulary; pp at most
the number of layers; at least pp pipeline chunks per step (micro_batch_num × gradient accumulation).
Which features compose with which is fitlm.rules' table, checked with the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitlm.config import Config
from fitlm.parallel_dims import divisors, layout_name


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int = 1

    def __str__(self) -> str:
        return layout_name(self.dp, self.tp, self.pp, self.cp)


def tp_problems(cfg: Config, tp: int) -> list[str]:
    from fitlm.parallel.tensor_parallel import tensor_parallel_problems  # rules live beside the code they protect

    return tensor_parallel_problems(
        cfg.model, tp, sequence_parallel=cfg.parallel.sequence_parallel and tp > 1, seq_length=cfg.data.seq_length
    )


def pp_problems(cfg: Config) -> list[str]:
    from fitlm.parallel.pipeline import pipeline_problems  # rules live beside the code they protect

    t = cfg.train
    return pipeline_problems(cfg.model, cfg.parallel, t.micro_batch_size, t.gradient_accumulation_steps)


def valid_layouts(cfg: Config, world_size: int, context_parallel: bool = False) -> list[Layout]:
    """Every (dp, tp, pp) with dp·tp·pp = world_size that passes the model-dependent rules; with
    `context_parallel`, also every cp > 1 (without pipeline parallel) that splits data.seq_length evenly."""
    out = []
    for cp in divisors(world_size) if context_parallel else [1]:
        if cp > 1 and cfg.data.seq_length % (2 * cp):
            continue
        for tp in divisors(world_size // cp):
            for pp in divisors(world_size // (cp * tp)) if cp == 1 else [1]:
                dp = world_size // (cp * tp * pp)
                trial = cfg.model_copy(
                    update={
                        "parallel": cfg.parallel.model_copy(
                            update={
                                "data_parallel": dp,
                                "tensor_parallel": tp,
                                "pipeline_parallel": pp,
                                "context_parallel": cp,
                                "micro_batch_num": max(cfg.parallel.micro_batch_num, pp),
                            }
                        )
                    }
                )
                if not tp_problems(cfg, tp) and not pp_problems(trial):
                    out.append(Layout(dp, tp, pp, cp))
    return out


def layout_problems(cfg: Config, world_size: int) -> list[str]:
    """All problems of cfg.parallel for `world_size` processes; each names the key, the arithmetic and the fix."""
    p = cfg.parallel
    out = []
    if p.world_size != world_size:
        layouts = ", ".join(str(x) for x in valid_layouts(cfg, world_size)) or "none for this model"
        cp = " × context_parallel" if p.context_parallel > 1 else ""
        cpv = f" × {p.context_parallel}" if p.context_parallel > 1 else ""
        out.append(
            f"parallel: data_parallel{cp} × tensor_parallel × pipeline_parallel = {p.data_parallel}{cpv} × "
            f"{p.tensor_parallel} × {p.pipeline_parallel} = {p.world_size}, but {world_size} processes run; "
            f"valid layouts for {world_size}: {layouts}"
        )
    out += tp_problems(cfg, p.tensor_parallel)
    out += pp_problems(cfg)
    return out
