"""Trainer components: schedule, token-weighted accumulation, recompute and precision equivalence."""

from __future__ import annotations

import pytest
import torch

from fitlm.config import TrainConfig, validate_dict
from fitlm.step.optim import lr_at
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import tiny_config


def test_schedule_warms_up_then_decays_to_min_lr():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # cosine midpoint
    assert lr_at(110, cfg) == pytest.approx(0.1)
    lin = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=100, lr_schedule="linear")
    assert lr_at(50, lin) == pytest.approx(0.5)


def make_trainer(tiny_corpus, tmp_path, **sections) -> Trainer:
    return Trainer(validate_dict(tiny_config(tiny_corpus, tmp_path / "out", **sections)))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_is_the_token_weighted_mean_of_the_whole_batch(tiny_corpus, tmp_path):
    trainer = make_trainer(tiny_corpus, tmp_path)
    batch = next(iter(trainer.loader))
    # Uneven target counts per micro batch: a mean of per-micro-batch means would weight them wrongly.
    batch["labels"][0, :50] = -100
    batch["labels"][1, :30] = -100
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    initial = {k: v.clone() for k, v in trainer.pm.model.state_dict().items()}

    loss_whole = trainer.step.forward_backward([batch])
    g_whole = grads(trainer.pm.model)
    trainer.pm.model.zero_grad(set_to_none=True)
    loss_accum = trainer.step.forward_backward(halves)
    g_accum = grads(trainer.pm.model)

    assert loss_accum.item() == pytest.approx(loss_whole.item(), rel=1e-6)
    for name in g_whole:
        torch.testing.assert_close(g_accum[name], g_whole[name], rtol=1e-5, atol=1e-7)
    # and it differs from the mean of means, so the test can tell the two apart
    trainer.pm.model.zero_grad(set_to_none=True)
    per_micro = [trainer.step.forward_backward([h]).item() for h in halves]
    assert abs(sum(per_micro) / 2 - loss_whole.item()) > 1e-4
    assert all(torch.equal(v, trainer.pm.model.state_dict()[k]) for k, v in initial.items())


def test_full_recompute_gives_the_same_loss_and_gradients(tiny_corpus, tmp_path):
    plain = make_trainer(tiny_corpus, tmp_path / "a")
    recomputed = make_trainer(tiny_corpus, tmp_path / "b", memory={"recompute": "full"})
    batch = next(iter(plain.loader))
    la, lb = plain.step.forward_backward([batch]), recomputed.step.forward_backward([batch])
    assert la.item() == pytest.approx(lb.item(), rel=1e-6)
    ga, gb = grads(plain.pm.model), grads(recomputed.pm.model)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7)
    assert set(plain.pm.model.state_dict()) == set(recomputed.pm.model.state_dict())  # names untouched


def test_o1_autocast_trains_close_to_fp32(tiny_corpus, tmp_path):
    fp32 = make_trainer(tiny_corpus, tmp_path / "a")
    o1 = make_trainer(tiny_corpus, tmp_path / "b", memory={"mixed_precision": "O1", "half_dtype": "bf16"})
    batch = next(iter(fp32.loader))
    l32, l16 = fp32.step.forward_backward([batch]).item(), o1.step.forward_backward([batch]).item()
    assert l16 == pytest.approx(l32, rel=2e-2)
    assert all(p.dtype == torch.float32 for p in o1.pm.model.parameters())


def test_unsupported_options_are_refused_together(tiny_corpus, tmp_path):
    from fitlm.config import ConfigError

    with pytest.raises(ConfigError) as e:
        make_trainer(
            tiny_corpus,
            tmp_path,
            train={"early_stopping_patience": 2, "eval_interval": 0},
            parallel={"tensor_parallel": 2},
        )
    assert len(e.value.problems) == 2
    assert "but 1 processes run" in e.value.problems[-1] and "dp1×tp1×pp1" in e.value.problems[-1]
    assert not (tmp_path / "out").exists()
