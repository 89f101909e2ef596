"""The MoE layer at its edges, against a per-token reference: every token to one expert, experts that get no
token, a single token, the fp32 router under autocast, stacked-expert gradients; the HF names round trip."""

from __future__ import annotations

import pytest
import torch

from fitlm.config import ModelConfig
from fitlm.finetune.lora import LoraError, resolve_targets
from fitlm.models.hf import from_hf_state_dict, to_hf_state_dict
from fitlm.models.moe import MoEFeedForward, load_balancing_loss
from fitlm.registry import build_model


def cfg(**kw) -> ModelConfig:
    base = dict(arch="qwen3_moe", hidden_size=16, num_layers=2, num_heads=2, vocab_size=64, max_seq_len=32)
    base.update(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=24)
    return ModelConfig(**{**base, **kw})


def reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its top-k experts of weight · expert(token) (plus the gated shared expert)."""
    flat = x.reshape(-1, x.shape[-1])
    _, weights, chosen = layer.route(flat)
    e = layer.experts
    out = []
    for t in range(flat.shape[0]):
        y = torch.zeros_like(flat[t])
        for w, i in zip(weights[t], chosen[t]):
            h = torch.nn.functional.silu(e.gate_proj[i] @ flat[t]) * (e.up_proj[i] @ flat[t])
            y = y + w * (e.down_proj[i] @ h)
        if hasattr(layer, "shared_expert"):
            y = y + torch.sigmoid(layer.shared_expert_gate(flat[t])) * layer.shared_expert(flat[t])
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("normalize,shared", [(False, None), (True, None), (False, 12)])
def test_dispatch_equals_the_per_token_reference(normalize, shared):
    torch.manual_seed(0)
    layer = MoEFeedForward(cfg(), normalize, shared)
    x = torch.randn(3, 7, 16)
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-5, atol=1e-6)


def test_every_token_to_one_expert_leaves_the_others_without_tokens_or_gradient():
    torch.manual_seed(1)
    layer = MoEFeedForward(cfg(num_experts_per_tok=1), normalize=True).train()
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[3] = 5.0  # positive inputs: expert 3 wins every token
    x = torch.rand(2, 6, 16) + 0.1
    y = layer(x)
    torch.testing.assert_close(y, reference(layer, x), rtol=1e-5, atol=1e-6)
    assert layer.expert_counts.tolist() == [0, 0, 0, 12, 0]
    y.sum().backward()
    g = layer.experts.gate_proj.grad
    assert g[3].abs().sum() > 0 and all(g[i].abs().sum() == 0 for i in (0, 1, 2, 4))
    # the aux loss of a collapsed router is E · (1 · p_3), near its maximum E
    assert load_balancing_loss([layer.router_logits], 1) > 4.0


def test_one_token_and_an_empty_call():
    torch.manual_seed(2)
    layer = MoEFeedForward(cfg(), normalize=False)
    x = torch.randn(1, 1, 16)
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-5, atol=1e-6)
    assert layer(torch.randn(1, 0, 16)).shape == (1, 0, 16)


def test_router_runs_in_fp32_under_autocast():
    layer = MoEFeedForward(cfg(), normalize=True).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(2, 4, 16, dtype=torch.bfloat16))  # O2/O3: half activations
    assert layer.router_logits.dtype == torch.float32 and y.dtype == torch.bfloat16


def test_eval_and_no_grad_forwards_keep_no_router_state():
    model = build_model(cfg()).train()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 5)))
    model.eval()(torch.randint(0, 64, (1, 5)))
    assert all(m.router_logits is None for m in model.modules() if isinstance(m, MoEFeedForward))


@pytest.mark.parametrize("arch,extra", [("mixtral", {}), ("qwen2_moe", {"shared_expert_intermediate_size": 12})])
def test_hf_names_round_trip(arch, extra):
    c = cfg(arch=arch, **extra, **({"moe_intermediate_size": None} if arch == "mixtral" else {}))
    model = build_model(c)
    hf = to_hf_state_dict(model, c)
    if arch == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.4.w2.weight" in hf
        assert "model.layers.1.block_sparse_moe.gate.weight" in hf
    else:
        assert (
            "model.layers.0.mlp.experts.4.down_proj.weight" in hf
            and "model.layers.0.mlp.shared_expert_gate.weight" in hf
        )
    back = from_hf_state_dict(hf, c)
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k


def test_lora_on_an_moe_model_targets_the_experts_and_never_the_router():
    """all-linear takes attention, a dense block's MLP and every stacked expert projection (one adapter per
    expert: fitlm.finetune.expert_lora), as PEFT's all-linear takes transformers 4's Linears, but not the router;
    a leaf name takes the dense block's Linear and the experts' projection alike, as PEFT matches leaf names."""
    model = build_model(cfg(mlp_only_layers=[1]))
    everything = resolve_targets(model, ["all-linear"])
    assert "model.layers.0.mlp.experts.down_proj" in everything and "model.layers.1.mlp.down_proj" in everything
    assert not any(n.endswith("mlp.gate") for n in everything)
    assert resolve_targets(model, ["gate_proj"]) == (
        "model.layers.1.mlp.gate_proj",
        "model.layers.0.mlp.experts.gate_proj",
    )
    assert resolve_targets(model, ["experts.gate_proj"]) == ("model.layers.0.mlp.experts.gate_proj",)
    with pytest.raises(LoraError, match="router"):
        resolve_targets(model, ["gate"])


def test_init_from_takes_the_aux_coefficient_from_the_weights_and_the_balance_keys_from_the_user():
    """router_aux_loss_coef, moe_balance, router_bias_update_rate and capacity_factor say how training balances the
    routing, not what the network is: with model.init_from a value the user sets stands (DPO sets moe_balance:
    none on a checkpoint trained with the aux loss), and an unset aux coefficient is the checkpoint's."""
    from fitlm.config import validate_dict
    from fitlm.finetune.init_from import resolve_init_from

    weights = cfg(router_aux_loss_coef=0.25)
    data = {"seq_length": 32}
    plain = resolve_init_from(validate_dict({"model": {"init_from": "/ckpt"}, "data": data}), weights)
    assert plain.model.router_aux_loss_coef == 0.25 and plain.model.moe_balance == "aux_loss"
    user = {"init_from": "/ckpt", "moe_balance": "none", "capacity_factor": 1.5, "router_aux_loss_coef": 0.0}
    tuned = resolve_init_from(validate_dict({"model": user, "data": data}), weights)
    assert (tuned.model.moe_balance, tuned.model.capacity_factor, tuned.model.router_aux_loss_coef) == ("none", 1.5, 0)
    assert tuned.model.num_experts == weights.num_experts  # the network is still the weights'
