"""fitlm.infer.packed_linear: decoding's oneDNN-packed Linear weights compute nn.Linear's products, follow the
weights when they change, leave training (autograd) and other modules alone, and are undone on exit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fitlm.infer.packed_linear import packable_dtypes, packed_linears

pytestmark = pytest.mark.skipif(not packable_dtypes(), reason="torch built without oneDNN (mkldnn)")


def _net(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(dtype)


@pytest.mark.parametrize("dtype", sorted(packable_dtypes(), key=str))
@pytest.mark.parametrize("rows", [(1, 1), (1, 7), (3, 1)])  # a decode step, a prompt, a batch of streams
def test_products_equal_nn_linear(dtype, rows):
    net, x = _net(dtype), torch.randn(*rows, 64).to(dtype)  # [B,T,C]
    with torch.inference_mode():
        ref = net(x)
        with packed_linears(net):
            assert all("forward" in m.__dict__ for m in net if isinstance(m, nn.Linear))  # really patched
            out = net(x)
    tol = 1e-5 if dtype == torch.float32 else 0.0  # fp32: another kernel's rounding; bf16: oneDNN's own kernel
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_a_changed_weight_is_packed_again():
    """An in-place update (what an optimizer step does) between two decodes reaches the packed copy."""
    net, x = _net(torch.float32), torch.randn(1, 64)
    with torch.inference_mode(), packed_linears(net):
        before = net(x)
    with torch.no_grad():
        net[0].weight.mul_(2.0)
    with torch.inference_mode():
        ref = net(x)
        with packed_linears(net):
            after = net(x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, ref, atol=1e-5, rtol=1e-5)


def test_training_calls_keep_autograd_and_the_patch_is_undone():
    net, x = _net(torch.float32), torch.randn(2, 64)
    with packed_linears(net):
        net(x).sum().backward()  # grad mode + trainable weights: nn.Linear's own forward
    assert net[0].weight.grad is not None and net[2].weight.grad is not None
    assert not any("forward" in m.__dict__ for m in net)


def test_subclasses_and_the_off_switch_are_left_alone(monkeypatch):
    class MyLinear(nn.Linear):  # e.g. a quantized layer: its own forward must run
        pass

    net = nn.Sequential(MyLinear(8, 8), nn.Linear(8, 8))
    with packed_linears(net):
        assert "forward" not in net[0].__dict__ and "forward" in net[1].__dict__
    monkeypatch.setenv("FITLM_PACKED_LINEAR", "0")
    with packed_linears(net):
        assert "forward" not in net[1].__dict__
