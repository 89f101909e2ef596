"""The global gradient norm and the clip folded into fused AdamW (fitlm.parallel.grad_norm, TrainStep.optimizer_step)."""

from __future__ import annotations

import pytest
import torch

from fitlm.config import validate_dict
from fitlm.parallel.grad_norm import clip_divisor, squared_norm
from fitlm.step.optim import clips_in_step
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import tiny_config


def test_squared_norm_is_the_fp64_norm():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) * 3 for s in [(512, 384), (1000,), (3, 5, 7), (8192, 64)]]
    exact = sum(float((t.double() ** 2).sum()) for t in grads)
    assert float(squared_norm(grads)) == pytest.approx(exact, rel=2e-6)
    # torch's own per-tensor norm is further off on the same numbers (what the dot product replaced)
    assert abs(float(torch.nn.utils.get_total_norm(grads)) ** 2 - exact) > 2e-6 * exact
    half = [t.bfloat16() for t in grads]  # O3's gradients: accumulated in fp32 (torch's norm stays in bf16)
    exact_half = sum(float((t.double() ** 2).sum()) for t in half)
    assert float(squared_norm(half)) == pytest.approx(exact_half, rel=1e-4)
    assert abs(float(torch.nn.utils.get_total_norm(half)) ** 2 - exact_half) > 1e-3 * exact_half
    assert float(squared_norm([])) == 0.0


def test_clip_divisor_is_the_reciprocal_of_torchs_clip_factor():
    norm = torch.tensor(5.0)
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.full((4,), 2.0)
    torch.nn.utils.clip_grads_with_norm_([param], 1.0, norm)
    assert torch.allclose(torch.full((4,), 2.0) / clip_divisor(norm, 1.0), param.grad, rtol=1e-6)
    assert not torch.allclose(param.grad, torch.full((4,), 2.0))
    assert float(clip_divisor(torch.tensor(0.5), 1.0)) == 1.0  # below the bound: gradients unchanged
    assert clip_divisor(norm, 0.0) is None and clip_divisor(norm, float("inf")) is None


def _trainer(tiny_corpus, path, clip: float, **memory) -> Trainer:
    return Trainer(validate_dict(tiny_config(tiny_corpus, path / "out", train={"grad_clip": clip}, memory=memory)))


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_fused_adamw_clips_in_its_own_pass_as_clip_grad_norm_does(tiny_corpus, tmp_path, monkeypatch, clip):
    trainer = _trainer(tiny_corpus, tmp_path, clip)
    step = trainer.step
    params = [p for p in trainer.pm.model.parameters() if p.requires_grad]
    assert clips_in_step(step.optimizer, params)
    step.forward_backward([next(iter(trainer.loader))])

    # The reference: torch's clip (gradients scaled in place) then the same fused AdamW, same groups, on copies.
    copies = {id(p): torch.nn.Parameter(p.detach().clone()) for p in params}
    for p in params:
        copies[id(p)].grad = p.grad.clone()
    ref_params = [copies[id(p)] for p in params]
    ref_opt = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [copies[id(p)] for p in g["params"]]}
                                 for g in step.optimizer.param_groups])
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, clip if clip > 0 else float("inf"))
    ref_opt.step()

    # The fold: no gradient is scaled before the optimizer's own pass.
    def refuse(*a, **k):
        raise AssertionError("gradients were scaled outside the optimizer")
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", refuse)
    norm, skipped = step.optimizer_step()
    assert not skipped and getattr(step.optimizer, "grad_scale", None) is None
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5)
    if clip:
        assert float(norm) > 4 * clip  # the clip did act in this step
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)

