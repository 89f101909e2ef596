"""GRPO through the trainer's step: the same completions cut into other micro batches give the same step.

Completions are sampled per prompt group with the group's own seed, so a step's rollout does not depend on how
its completions are cut into micro batches (or ranks: the dp2 case below). For the loss
types whose value is a mean over completions (grpo), over the step's tokens (dapo) or per completion slot
(dr_grpo), the step's loss and gradient then equal TRL's over the whole batch whatever the accumulation: micro
batches of 8 × 1, 4 × 2 and 2 × 4 give the same loss and gradient norm, step after step (lr > 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fitlm.config import validate_dict
from fitlm.data.prompts import pack_prompts
from tests.e2e.test_grpo_cli import MODEL, REWARD
from tests.e2e.test_grpo_cli import config as cli_config
from tests.e2e.test_moe_cli import MOE as MOE_CLI


@pytest.fixture(scope="module")
def prompts(tiny_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo-step")
    (root / "rewards.py").write_text(REWARD)
    src = root / "p.jsonl"
    src.write_text(
        "".join(json.dumps({"prompt": f"Speak of {w}:"}) + "\n" for w in ("love", "war", "the sea", "kings"))
    )
    pack_prompts([src], Path(tiny_corpus["tokenizer"]), root / "prompts", None, 16, False)
    return root


def config(root: Path, out: Path, micro: int, accumulation: int, loss_type: str, **parallel) -> dict:
    grpo = {"loss_type": loss_type, "beta": 0.05, "max_completion_length": 10}
    train = {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation, "max_steps": 3, "lr": 3e-2}
    return cli_config(root, MODEL, out, grpo, train={**train, "seed": 5, "observe": {}}, parallel=parallel)


# kl and the clip ratios are means over each micro batch's tokens, then over the micro batches (TRL's logging):
# they change with the cut, the step's loss and gradient do not
KEYS = ("loss", "grad_norm", "reward", "completions/mean_length")


def history(cfg: dict) -> list[dict]:
    from fitlm.train.trainer import Trainer

    return Trainer(validate_dict(cfg)).fit().history


# dapo (its denominator spans the step) in the fast tier; the per-micro-batch means under `make test`
@pytest.mark.parametrize(
    "loss_type", ["dapo", pytest.param("grpo", marks=pytest.mark.slow), pytest.param("dr_grpo", marks=pytest.mark.slow)]
)
def test_the_step_does_not_depend_on_how_its_completions_are_cut(prompts, tmp_path, loss_type):
    whole = history(config(prompts, tmp_path / "whole", 8, 1, loss_type))
    assert whole[0]["reward_std"] > 0 and whole[-1]["kl"] > 0  # something is learned: the comparison has teeth
    for micro, acc in ((4, 2), (2, 4)):
        cut = history(config(prompts, tmp_path / f"cut{micro}", micro, acc, loss_type))
        for a, b in zip(whole, cut):
            for key in KEYS:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (micro, a["step"], key)


def _dp_worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    from fitlm.parallel.mesh import exit_process

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    results = {name: history(cfg) for name, cfg in cases.items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    exit_process(0)


# A Qwen3-MoE with a dense block among routed ones, the router's aux loss on (tests/e2e/test_moe_cli.py's)
MOE = {**MODEL, **MOE_CLI, "router_aux_loss_coef": 0.01}


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero_stage,moe,method",
    [
        (0, False, "full"),
        (1, False, "full"),
        (2, False, "full"),
        (3, False, "full"),
        (3, False, "lora"),
        (3, False, "qlora"),
        (0, True, "full"),
        pytest.param(3, True, "full", id="3-moe-ep2"),
    ],
)
def test_data_parallel_equals_one_process(prompts, tmp_path, zero_stage, moe, method):
    """dp2, each rank sampling its own prompt's group, equals one process sampling both groups; under ZeRO-2/3 and
    expert parallel every forward is a collective, and the ranks decode in lockstep (their completions end at
    different steps). The MoE cases: dp2 and dp2 × ep2 (each rank's experts serve both ranks' tokens)."""
    from tests.distributed.spawn import run_world

    logged = {"log_completions": True}  # rollouts.jsonl: the main rank writes every rank's completions
    ep = {"expert_parallel": 2} if moe and zero_stage == 3 else {}
    single = config(prompts, tmp_path / "single", 4, 2, "dapo")
    dp2 = config(prompts, tmp_path / "dp2", 4, 1, "dapo", data_parallel=2, zero_stage=zero_stage, **ep)
    for cfg in (single, dp2):  # LoRA / QLoRA: the reference is the adapters switched off
        cfg["finetune"].update({"method": method} if method == "full" else {"method": method, "lora": {"r": 4}})
        if method == "qlora":  # widths whose halves are whole NF4 groups: both layouts quantize the same weights
            cfg["model"] = {**cfg["model"], "hidden_size": 256, "num_heads": 8, "num_kv_heads": 4}
            cfg["model"]["intermediate_size"] = 512
    single = history(_observe(_model(single, moe, ep), logged))
    cases = {"dp2": _observe(_model(dp2, moe, ep), logged)}
    (ranks := tmp_path / "ranks").mkdir()
    got = run_world(_dp_worker, __name__, 2, cases, ranks, 300, "GRPO data-parallel workers")[0]["dp2"]
    assert len(got) == len(single) == 3
    for a, b in zip(single, got):  # the same micro batches: the logged kl is the same too
        for key in (*KEYS, "kl", "aux_loss"):
            assert (key in b) == (key in a), key
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    rollouts = [(tmp_path / run / "rollouts.jsonl").read_text().splitlines() for run in ("single", "dp2")]
    assert len(rollouts[0]) == 3 * 8 and rollouts[1] == rollouts[0]


def _model(cfg: dict, moe: bool, ep: dict) -> dict:
    cfg["model"] = MOE if moe else cfg["model"]
    if ep:  # no frozen reference copy of split experts (fitlm.rules): beta 0
        cfg["finetune"]["grpo"]["beta"] = 0.0
    return cfg


def _observe(cfg: dict, observe: dict) -> dict:
    cfg["train"]["observe"] = observe
    return cfg
