"""Checkpoints in one process: bit-exact resume after SIGTERM, async save, keep_last, merge, inspect, crash leftovers.

Runs use the Trainer in-process (no subprocess start-up) on the tiny corpus; `train.peak_tflops` is set
so no GEMM is measured.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fitlm.checkpoint.errors import TrainingInterrupted
from fitlm.checkpoint.store import META_FILE, list_checkpoints
from fitlm.config import validate_dict
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import read_metrics, tiny_config

STEPS = 8


def ckpt_config(corpus, out: Path, train: dict | None = None, **sections) -> dict:
    """The tiny run with a checkpoint every 2 steps (keep 3), every step logged, no evaluation."""
    t = {"max_steps": STEPS, "eval_interval": 0, "peak_tflops": 1.0, **(train or {})}
    ck = {"interval": 2, "keep_last": 3, **sections.pop("checkpoint", {})}
    return tiny_config(corpus, out, train=t, checkpoint=ck, **sections)


def train_in_process(cfg: dict, stop_at: int | None = None) -> Trainer:
    """Train; with `stop_at`, the process sends itself SIGTERM at the end of that step (preemption)."""
    trainer = Trainer(validate_dict(cfg))
    if stop_at is not None:
        original = trainer.checkpointer.after_step

        def after_step(step, *args):
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(step, *args)

        trainer.checkpointer.after_step = after_step
    trainer.fit()
    return trainer


def losses(out: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> Path:
    """The uninterrupted single-process run (checkpoints at 4, 6, 8 kept)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train_in_process(ckpt_config(tiny_corpus, out))
    return out


@pytest.mark.process
def test_sigterm_saves_then_resume_is_bit_exact(tiny_corpus, tmp_path, reference):
    cfg = ckpt_config(tiny_corpus, tmp_path / "run")
    with pytest.raises(TrainingInterrupted) as stopped:
        train_in_process(cfg, stop_at=5)
    assert stopped.value.step == 5  # not on the 2-step interval: SIGTERM made this checkpoint
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 4, 5]
    assert not (tmp_path / "run" / "model").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored

    train_in_process(cfg)  # checkpoint.resume: auto continues from step 5 in the same output_dir
    assert losses(tmp_path / "run") == losses(reference)  # steps 1-5 from the first attempt, 6-8 resumed
    ours, theirs = (
        load_file(str(tmp_path / "run/model/model.safetensors")),
        load_file(str(reference / "model/model.safetensors")),
    )
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.process
def test_async_save_trains_identically_and_writes_complete_checkpoints(tiny_corpus, tmp_path, reference):
    out = tmp_path / "run"
    trainer = train_in_process(ckpt_config(tiny_corpus, out, checkpoint={"async_save": True}))
    assert losses(out) == losses(reference)
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [4, 6, 8]  # keep_last 3
    assert len(trainer.checkpointer.save_seconds) == 4
    for _, path in list_checkpoints(out / "checkpoints"):
        assert (path / META_FILE).is_file() and (path / ".metadata").is_file()
    # the background write holds the state of its step (a copy), not what the optimizer did next
    resumed = tmp_path / "resumed"
    train_in_process(ckpt_config(tiny_corpus, resumed, checkpoint={"resume": str(out / "checkpoints/step_00000006")}))
    assert losses(resumed) == losses(reference)[6:]


def test_merge_equals_the_live_weights_in_every_format(tiny_corpus, tmp_path, reference):
    from fitlm.checkpoint.merge import merge_checkpoint
    from fitlm.models.io import load_model_dir

    live = load_file(str(reference / "model" / "model.safetensors"))  # the model at step 8, gathered live
    merge_checkpoint(reference, tmp_path / "w.safetensors")
    merged = load_file(str(tmp_path / "w.safetensors"))
    assert merged.keys() == live.keys()
    assert all(torch.equal(merged[k], live[k]) for k in live)
    merge_checkpoint(reference / "checkpoints" / "step_00000008", tmp_path / "hf", "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(hf[k], live[k]) for k in live)
    merge_checkpoint(reference, tmp_path / "fitlm", "fitlm")
    model = load_model_dir(tmp_path / "fitlm").model  # usable as a MODEL argument
    assert torch.equal(model.state_dict()["model.norm.weight"], live["model.norm.weight"])
    # an earlier checkpoint is a different model: the comparison can tell them apart
    merge_checkpoint(reference / "checkpoints" / "step_00000006", tmp_path / "w6.safetensors")
    assert not torch.equal(load_file(str(tmp_path / "w6.safetensors"))["lm_head.weight"], live["lm_head.weight"])


def test_inspect_json_through_the_cli(reference, capsys):
    from fitlm.cli import main

    assert main(["ckpt", "inspect", str(reference), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 8 and info["layout"]["name"] == "dp1×tp1×pp1 zero0"
    assert info["checkpoints_in_run"] == [4, 6, 8]
    assert info["config"]["model"]["hidden_size"] == 64
    assert info["params"] == sum(v.numel() for v in load_file(str(reference / "model/model.safetensors")).values())
    assert info["bytes"] == sum(info["files"].values()) > 0
    assert info["contents"]["optim"]["elements"] == 2 * info["params"] + info["contents"]["optim"]["tensors"] // 3


def test_stale_temporary_checkpoint_is_removed_and_training_resumes_from_the_last_complete(
    tiny_corpus, tmp_path, reference
):
    cfg = ckpt_config(tiny_corpus, tmp_path / "run")
    with pytest.raises(TrainingInterrupted):
        train_in_process(cfg, stop_at=4)
    root = tmp_path / "run" / "checkpoints"
    # What a crash half-way through saving step 6 leaves: a temporary directory with partial shards.
    stale = root / ".tmp-step_00000006"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    train_in_process(cfg)
    assert not stale.exists()
    assert losses(tmp_path / "run") == losses(reference)


@pytest.mark.process
def test_extending_a_finished_run_with_more_steps_resumes_it(tiny_corpus, tmp_path):
    # constant schedule: 6 steps then 2 more equal 8 steps in one go (max_steps is a harmless change)
    train = {"lr_schedule": "constant", "warmup_steps": 0}
    short = ckpt_config(tiny_corpus, tmp_path / "a", train={**train, "max_steps": 6})
    train_in_process(short)
    train_in_process(ckpt_config(tiny_corpus, tmp_path / "a", train={**train, "max_steps": 8}))
    train_in_process(ckpt_config(tiny_corpus, tmp_path / "b", train={**train, "max_steps": 8}))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
