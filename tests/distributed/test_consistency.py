"""Rank consistency (train.observe.consistency_interval) on 2 gloo ranks running the real Trainer: a replica whose
weights were perturbed is caught, with the ranks, the parameter and the step named; healthy replicas pass."""

from __future__ import annotations

import json
import os

import torch

from fitlm.config import validate_dict
from fitlm.parallel.mesh import exit_process
from fitlm.train.consistency import RanksDiverged
from fitlm.train.trainer import Trainer
from tests.distributed.spawn import run_world
from tests.e2e.helpers import tiny_config

PERTURBED = "lm_head.weight"


def run_case(rank: int, cfg: dict, perturb: bool) -> dict:
    trainer = Trainer(validate_dict(cfg))
    if perturb and rank == 1:
        with torch.no_grad():
            dict(trainer.pm.model.named_parameters())[f"module.{PERTURBED}"].add_(1e-3)
    try:
        return {"steps": trainer.fit().steps, "error": None}
    except RanksDiverged as e:
        return {"error": str(e)}


def worker(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # 2 cores, 2 processes
    # The perturbed case comes first: it stops without tearing the process group down, so the next reuses it.
    results = {name: run_case(rank, cfg, perturb) for name, cfg, perturb in cases}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    exit_process(0)  # not a normal exit: see fitlm.parallel.mesh.exit_process


def test_desynchronised_replica_is_caught_and_healthy_replicas_pass(tiny_corpus, tmp_path):
    def cfg(name: str, zero_stage: int) -> dict:
        return tiny_config(
            tiny_corpus,
            tmp_path / name,
            parallel={"data_parallel": 2, "zero_stage": zero_stage},
            train={
                "max_steps": 4,
                "eval_interval": 0,
                "micro_batch_size": 2,
                "observe": {"consistency_interval": 2, "tensorboard": False},
            },
        )

    cases = [("ddp-perturbed", cfg("a", 0), True), ("zero1-healthy", cfg("b", 1), False)]
    results = run_world(worker, __name__, 2, cases, tmp_path, 240, "consistency world")
    for r in results:  # every rank stops with the same verdict
        error = r["ddp-perturbed"]["error"]
        assert error is not None and "step 2" in error and "ranks 0, 1 disagree" in error, error
        assert PERTURBED in error and "Ranks diverge" in error
        assert r["zero1-healthy"] == {"steps": 4, "error": None}
