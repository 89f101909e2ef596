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
    net = _net(torch.float32)
    _check_packed_copies_follow(net, torch.randn(1, 64), [net[0].weight])


def _check_packed_copies_follow(net: nn.Module, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Doubling `weights` in place between two packed decodes changes the packed products to the new nn.Linear's."""
    with torch.inference_mode(), packed_linears(net):
        before = net(x)
    with torch.no_grad():
        for w in weights:
            w.mul_(2.0)
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


def _llama(dtype: torch.dtype, arch: str = "llama") -> nn.Module:
    from fitlm.config import ModelConfig
    from fitlm.registry import build_model

    cfg = ModelConfig(
        arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=96, max_seq_len=32
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()  # (initialised to zero: a dropped bias would go unseen)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", sorted(packable_dtypes(), key=str))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases, fused with them
def test_fused_qkv_and_gate_up_equal_the_separate_products(dtype, arch):
    """q/k/v and gate/up run as one packed product each, and the model's logits stay those of nn.Linear's."""
    from fitlm.models.layers import GatedMLP, SelfAttention

    model, ids = _llama(dtype, arch), torch.tensor([[3, 1, 4, 1, 5, 9, 2]])  # [1,T]
    groups = [m for m in model.modules() if isinstance(m, (SelfAttention, GatedMLP))]
    assert (arch == "qwen2") == (groups[0].q_proj.bias is not None)
    calls = []
    with torch.inference_mode():
        ref = model(ids)
        with packed_linears(model):
            assert all({"project", "forward"} & set(m.__dict__) for m in groups)  # each group really fused
            for name, m in model.named_modules():
                if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                    m.register_forward_hook(lambda *a: calls.append(1))  # fused: not called alone
            out = model(ids)
    assert not calls
    assert not any({"project", "forward"} & set(m.__dict__) for m in groups)  # undone on exit
    tol = 1e-5 if dtype == torch.float32 else 0.0  # bf16: the same oneDNN kernel, each output row its own
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_a_hooked_projection_keeps_its_own_call_and_weights_are_followed():
    """A group with a hooked member (e.g. an adapter or an activation probe) is not fused; an in-place change of
    one member's weight reaches the fused packed copy."""
    model, ids = _llama(torch.float32), torch.tensor([[3, 1, 4]])
    attn = model.model.layers["0"].self_attn
    seen = []
    handle = attn.k_proj.register_forward_hook(lambda *a: seen.append(1))
    with torch.inference_mode(), packed_linears(model):
        assert "project" not in attn.__dict__ and "project" in model.model.layers["1"].self_attn.__dict__
        model(ids)
    assert seen
    handle.remove()
    layer = model.model.layers["1"]
    _check_packed_copies_follow(model, ids, [layer.self_attn.v_proj.weight, layer.mlp.up_proj.weight])


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN packs no bf16 on this CPU")
def test_a_model_cast_after_decoding_is_packed_again():
    """model.to(dtype) keeps each Parameter and may leave its version at 0: the packed copies (single and fused)
    must be made again from the new tensors, not reused from the old dtype's."""
    model, ids = _llama(torch.float32, "qwen2"), torch.tensor([[3, 1, 4, 1, 5, 9, 2]])  # [1,T]
    with torch.inference_mode(), packed_linears(model):
        model(ids)  # (packs the fp32 weights)
    model.to(torch.bfloat16)
    with torch.inference_mode():
        ref = model(ids)
        with packed_linears(model):
            out = model(ids)
    torch.testing.assert_close(out, ref, atol=0.0, rtol=0.0)
