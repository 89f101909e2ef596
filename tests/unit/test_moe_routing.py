"""Routing and balance of the MoE layer (model.moe_balance, model.capacity_factor): aux-free balancing's bias
picks the top-k while the output weights stay the unbiased probabilities, its update is DeepSeek-V3's formula on
the step's counts and balances a skewed router, no gradient or state-dict entry reaches it, no auxiliary loss is
added; `none` neither adds a loss nor moves a bias; a capacity drops exactly the latest slots of each full expert,
as a reference loop that zeros them computes; the config keys and their refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fitlm.config import ConfigError, ModelConfig
from fitlm.config.loading import validate_dict
from fitlm.models.experts import GroupedExperts
from fitlm.models.hf import to_hf_state_dict
from fitlm.models.moe import MoEFeedForward, capacity_kept, dispatch, kept_slots
from fitlm.registry import build_model
from fitlm.step.router_balance import RouterBalance
from tests.unit.test_moe import cfg, reference


def layer(**kw) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(cfg(**kw), normalize=kw.pop("normalize", True) if "normalize" in kw else True)


def balance(layers, mode="aux_free", rate=0.01, coef=0.5) -> RouterBalance:
    return RouterBalance(layers, layers[0].top_k, coef, reduce=lambda t: t, mode=mode, rate=rate)


# ---------------------------------------------------------------------------------------------- aux_free


@pytest.mark.parametrize("normalize", [True, False])
def test_the_bias_picks_the_top_k_and_the_weights_stay_unbiased(normalize):
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg(moe_balance="aux_free"), normalize)
    x = torch.randn(2, 9, 16)
    flat = x.reshape(-1, 16)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4]))
    logits, weights, chosen = moe.route(flat)
    probs = F.softmax(flat @ moe.gate.weight.t(), dim=-1)
    want = (probs + moe.expert_bias).topk(2, dim=-1).indices
    assert torch.equal(chosen, want)
    assert not torch.equal(chosen, probs.topk(2, dim=-1).indices)  # the bias changed some choices
    w = probs.gather(-1, want)
    torch.testing.assert_close(weights, w / w.sum(-1, keepdim=True) if normalize else w)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


def test_the_bias_is_a_buffer_without_gradient_outside_the_state_dict():
    moe = build_model(cfg(moe_balance="aux_free"))
    layers = [m for m in moe.modules() if isinstance(m, MoEFeedForward)]
    assert layers and all(m.expert_bias is not None and m.expert_bias.dtype == torch.float32 for m in layers)
    assert not any("expert_bias" in n for n, _ in moe.named_parameters())
    assert not any("expert_bias" in k for k in moe.state_dict())  # nor in HF exports, GGUF, model_keys
    assert not any("bias" in k and "mlp.gate" in k for k in to_hf_state_dict(moe, cfg(moe_balance="aux_free")))
    for m in layers:
        m.expert_bias.fill_(0.1)
    moe.train()
    moe(torch.randint(0, 64, (2, 8))).sum().backward()
    assert all(m.expert_bias.grad is None and not m.expert_bias.requires_grad for m in layers)
    moe.to(torch.bfloat16)  # precision O3's cast: the bias stays fp32
    assert all(m.expert_bias.dtype == torch.float32 for m in layers)
    plain = build_model(cfg())
    assert all(m.expert_bias is None for m in plain.modules() if isinstance(m, MoEFeedForward))


def test_the_bias_update_is_the_formula_on_the_step_counts():
    a, b = MoEFeedForward(cfg(moe_balance="aux_free"), True), MoEFeedForward(cfg(moe_balance="aux_free"), True)
    bal = balance([a, b], rate=0.01)
    for counts in ([[5, 1, 3, 3, 0], [2, 2, 2, 2, 4]], [[1, 1, 3, 3, 0], [2, 2, 2, 0, 0]]):  # two micro batches
        for m, c in zip((a, b), counts):
            m.router_logits, m.expert_counts = torch.randn(6, 5), torch.tensor(c)
        assert bal.micro_loss() is None  # no auxiliary loss under aux_free, whatever router_aux_loss_coef says
    bal.observe()
    load = torch.tensor([[6.0, 2, 6, 6, 0], [4, 4, 4, 2, 4]])  # summed over the micro batches
    bal.after_optimizer_step(applied=True)
    for m, row in zip((a, b), load):
        torch.testing.assert_close(m.expert_bias, 0.01 * torch.sign(row.mean() - row))
    assert bal.metrics["router_bias_max"] == pytest.approx(0.01)
    before = a.expert_bias.clone()
    a.router_logits, a.expert_counts = torch.randn(6, 5), torch.tensor([9, 0, 0, 0, 0])
    b.router_logits, b.expert_counts = torch.randn(6, 5), torch.tensor([9, 0, 0, 0, 0])
    bal.micro_loss()
    bal.observe()
    bal.after_optimizer_step(applied=False)  # a skipped step (overflow, guard) leaves the bias
    assert torch.equal(a.expert_bias, before)


def test_the_bias_balances_a_skewed_router():
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg(moe_balance="aux_free", num_experts_per_tok=1), True).train()
    with torch.no_grad():
        moe.gate.weight.mul_(3)
        moe.gate.weight[0] += 0.5  # inputs mostly positive: expert 0 wins most tokens
    x = torch.randn(4, 32, 16) + 0.5
    bal = balance([moe], rate=0.01)
    loads = []
    for _ in range(60):
        moe(x)
        bal.micro_loss()
        bal.observe()
        loads.append(bal.metrics["expert_load"])
        bal.after_optimizer_step(applied=True)
    assert loads[0] > 3.0  # max/mean tokens per expert (E/k = 5: every token to one expert)
    assert max(loads[-10:]) < 1.25


def test_the_bias_round_trips_through_the_checkpoint_state():
    layers = [MoEFeedForward(cfg(moe_balance="aux_free"), True) for _ in range(2)]
    for i, m in enumerate(layers):
        m.expert_bias.copy_(torch.arange(5.0) * (i + 1) / 7)
    state = balance(layers).state_dict()
    fresh = [MoEFeedForward(cfg(moe_balance="aux_free"), True) for _ in range(2)]
    balance(fresh).load_state_dict(state)
    for m, f in zip(layers, fresh):
        assert torch.equal(m.expert_bias, f.expert_bias)
    with pytest.raises(ValueError, match="routing biases"):
        balance(fresh[:1]).load_state_dict(state)
    f = fresh[0]
    f.reset_expert_bias()  # what materialize does to a meta-built layer's storage
    assert not f.expert_bias.any()


def test_aux_loss_mode_adds_the_weighted_loss_and_none_adds_nothing():
    x = torch.randn(2, 6, 16)
    for mode, added in (("aux_loss", True), ("none", False), ("aux_free", False)):
        torch.manual_seed(0)
        moe = MoEFeedForward(cfg(moe_balance=mode), True).train()
        bal = balance([moe], mode=mode, coef=0.5)
        moe(x)
        term = bal.micro_loss()
        assert (term is not None) is added, mode
        bal.observe()
        assert "aux_loss" in bal.metrics and ("router_bias_max" in bal.metrics) is (mode == "aux_free")
        bal.after_optimizer_step(applied=True)
        if mode == "aux_free":
            assert moe.expert_bias is not None and moe.expert_bias.abs().max() > 0
        else:  # no bias to move, nothing to checkpoint
            assert moe.expert_bias is None and bal.state_dict() == {}


# ---------------------------------------------------------------------------------------------- capacity


def capacity_reference(x, weights, chosen, experts: GroupedExperts, c: int):
    """Token by token, in token order: each slot runs unless its expert already took c slots (then it adds 0)."""
    taken = [0] * experts.gate_proj.shape[0]
    out, dropped = [], 0
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for w, i in zip(weights[t], chosen[t].tolist()):
            if taken[i] >= c:
                dropped += 1
                continue
            taken[i] += 1
            h = F.silu(experts.gate_proj[i] @ x[t]) * (experts.up_proj[i] @ x[t])
            y = y + w * (experts.down_proj[i] @ h)
        out.append(y)
    return torch.stack(out), dropped


def test_a_capacity_drops_the_latest_slots_of_each_full_expert():
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 6, init_std=0.5)
    chosen = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0], [1, 2]])  # slots: e0 5, e1 4, e2 3
    weights = torch.rand(6, 2)
    x = torch.randn(6, 8)
    counts = torch.bincount(chosen.reshape(-1), minlength=3)
    kept = kept_slots(counts, counts.tolist(), 0.5)  # C = ceil(0.5 · 12 / 3) = 2
    assert kept == [2, 2, 2]
    y, routed = dispatch(x, weights, chosen, experts, kept)
    want, dropped = capacity_reference(x, weights, chosen, experts, 2)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert dropped == 12 - 6 and routed.tolist() == [5, 4, 3]
    # by hand: expert 0 keeps tokens 0 and 1, expert 1 tokens 0 and 2, expert 2 tokens 1 and 4
    only0 = dispatch(x[:1], weights[:1], chosen[:1], experts)[0]
    torch.testing.assert_close(y[0], only0[0], rtol=1e-5, atol=1e-6)  # token 0 keeps both experts
    assert torch.equal(y[3], torch.zeros(8)) and torch.equal(y[5], torch.zeros(8))  # both slots of 3 and 5 dropped


def test_a_large_capacity_is_dropless_and_the_layer_counts_the_dropped():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16)
    base = MoEFeedForward(cfg(), True).train()
    roomy = MoEFeedForward(cfg(capacity_factor=5.0), True).train()  # C = N·k: nothing can be dropped
    roomy.load_state_dict(base.state_dict())
    assert torch.equal(roomy(x), base(x))
    assert roomy.dropped_slots.tolist() == [0.0, 42.0]
    tight = MoEFeedForward(cfg(capacity_factor=0.5), True).train()
    tight.load_state_dict(base.state_dict())
    y = tight(x)
    _, w, chosen = tight.route(x.reshape(-1, 16))
    c = math.ceil(0.5 * 21 * 2 / 5)
    want, dropped = capacity_reference(x.reshape(-1, 16), w, chosen, tight.experts, c)
    torch.testing.assert_close(y.reshape(-1, 16), want, rtol=1e-5, atol=1e-6)
    assert tight.dropped_slots.tolist() == [float(dropped), 42.0] and dropped > 0
    bal = balance([tight], mode="aux_loss")
    bal.micro_loss()
    bal.observe()
    assert bal.metrics["dropped_tokens"] == pytest.approx(dropped / 42)


def test_capacity_over_sources_keeps_the_earlier_sources_first():
    counts = torch.tensor([[3, 0, 1, 0], [2, 1, 1, 0]])  # two sources, 8 slots, C = ceil(1 · 8 / 4) = 2
    assert capacity_kept(counts, 1.0).tolist() == [[2, 0, 1, 0], [0, 1, 1, 0]]


# ---------------------------------------------------------------------------------------------- config


def test_configs_without_the_keys_keep_todays_balance():
    m = ModelConfig(arch="qwen3_moe", num_experts=4)
    assert (m.moe_balance, m.router_bias_update_rate, m.capacity_factor) == ("aux_loss", 0.001, None)


@pytest.mark.parametrize(
    "key,value,says",
    [
        ("moe_balance", "aux-free", "model.moe_balance"),
        ("router_bias_update_rate", 0, "model.router_bias_update_rate"),
        ("capacity_factor", -1.0, "model.capacity_factor"),
        ("capacity_factor", 0, "model.capacity_factor"),
    ],
)
def test_bad_balance_values_name_the_key(key, value, says):
    model = {"arch": "qwen3_moe", "num_experts": 4, "intermediate_size": 64, key: value}
    with pytest.raises(ConfigError) as e:
        validate_dict({"model": model}, "test")
    assert says in str(e.value)
    print(e.value)
