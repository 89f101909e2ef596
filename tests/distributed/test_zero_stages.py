"""What each ZeRO stage stores per data-parallel rank (fitlm.parallel_dims.ZERO_STAGES, which the planner
reads) is what the engines really hold: 2 gloo ranks, the real Trainer, each stage 0-3, local bytes of
parameters, gradients and optimizer states counted after one step's backward and update."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fitlm.config import validate_dict
from fitlm.parallel.mesh import exit_process
from fitlm.parallel_dims import ZERO_STAGES
from fitlm.train.trainer import Trainer
from tests.distributed.spawn import run_world
from tests.e2e.helpers import tiny_config

DP = 2


def local_numel(tensors) -> int:
    """Elements this rank stores: a DTensor's local shard, a plain tensor whole."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors if t is not None)


def optimizer_states(optimizer) -> list[torch.Tensor]:
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its share in .optim
    return [v for s in local.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]


def measure(cfg: dict) -> dict:
    trainer = Trainer(validate_dict(cfg))
    step, params = trainer.step, [p for m in trainer.pm.modules for p in m.parameters()]
    batches = iter(trainer.loader)
    out = {"full": sum(p.numel() for p in params)}  # DTensor.numel() is the global size
    step.forward_backward([next(batches) for _ in range(cfg["train"]["gradient_accumulation_steps"])])
    out["grads"] = local_numel(p.grad for p in params)
    step.optimizer_step()
    out["params"] = local_numel(params)
    out["optimizer"] = local_numel(optimizer_states(step.optimizer)) / 2  # two AdamW moments per element
    trainer.release_lock()
    return out


def worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # 2 cores, 2 processes
    results = {stage: measure(cfg) for stage, cfg in cases.items()}
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    exit_process(0)  # not a normal exit: see fitlm.parallel.mesh.exit_process


def test_each_zero_stage_stores_what_the_table_says(tiny_corpus, tmp_path):
    cases = {
        str(z): tiny_config(
            tiny_corpus,
            tmp_path / f"zero{z}",
            parallel={"data_parallel": DP, "zero_stage": z},
            train={
                "max_steps": 1,
                "eval_interval": 0,
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 1,
                "observe": {"tensorboard": False},
            },
        )
        for z in ZERO_STAGES
    }
    ranks = run_world(worker, __name__, DP, cases, tmp_path, 240, "ZeRO stage workers")
    for stage, table in ZERO_STAGES.items():
        per_rank = [r[str(stage)] for r in ranks]
        full = per_rank[0]["full"]
        for component in ("params", "grads", "optimizer"):
            held = [r[component] for r in per_rank]
            where = f"zero {stage} {component}: ranks hold {held} of {full}"
            if table[component] == "1":
                assert held == [full] * DP, where  # a whole replica on every rank
            else:  # 1/dp: disjoint shares that together make one copy
                assert sum(held) == full and max(held) < full, where
