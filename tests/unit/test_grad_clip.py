"""The global gradient norm and the clip by it (fitlm.parallel.grad_norm, ParallelModel.clip_grad_norm)."""

from __future__ import annotations

import pytest
import torch

from fitlm.config import validate_dict
from fitlm.parallel.grad_norm import clip_by_norm, squared_norm
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


def _params(scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(64, 32), (100,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


def test_clip_by_norm_is_torchs_clip_and_skips_the_pass_when_it_changes_nothing(monkeypatch):
    norm = squared_norm([p.grad for p in _params(1.0)]).sqrt()
    for bound in (0.5, 0.99 * float(norm)):  # far above the bound, and just above it
        ours, theirs = _params(1.0), _params(1.0)
        clip_by_norm(ours, bound, norm)
        torch.nn.utils.clip_grads_with_norm_(theirs, bound, norm)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))  # bit for bit: every layout clips alike
        assert not torch.equal(ours[0].grad, _params(1.0)[0].grad)  # and it did clip

    def refuse(*a, **k):
        raise AssertionError("a pass over the gradients that changes nothing")

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", refuse)
    small = _params(1e-3)
    before = [p.grad.clone() for p in small]
    clip_by_norm(small, 1.0, squared_norm([p.grad for p in small]).sqrt())
    clip_by_norm(small, 0.0, torch.tensor(5.0))  # grad_clip 0: off
    assert all(torch.equal(a, p.grad) for a, p in zip(before, small))


@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_the_trainers_step_clips_as_torch_does(tiny_corpus, tmp_path, clip):
    trainer = Trainer(validate_dict(tiny_config(tiny_corpus, tmp_path / "out", train={"grad_clip": clip})))
    step = trainer.step
    params = [p for p in trainer.pm.model.parameters() if p.requires_grad]
    step.forward_backward([next(iter(trainer.loader))])
    # The reference: torch's clip by the same norm (fp64-close; torch's own differs by ~1e-5), then the same AdamW,
    # same groups, on copies.
    copies = {id(p): torch.nn.Parameter(p.detach().clone()) for p in params}
    for p in params:
        copies[id(p)].grad = p.grad.clone()
    ref_opt = torch.optim.AdamW(
        [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [copies[id(p)] for p in g["params"]]}
            for g in step.optimizer.param_groups
        ]
    )
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(list(copies.values()), clip, squared_norm([p.grad for p in params]).sqrt())
    ref_opt.step()
    norm, skipped = step.optimizer_step()
    assert not skipped and float(norm) == pytest.approx(float(ref_norm), rel=1e-5)
    if clip < 1:
        assert float(norm) > 4 * clip  # the clip did act in this step
    for p in params:
        assert torch.equal(p.detach(), copies[id(p)].detach())
