"""Mixture-of-experts pieces against transformers: transformers 5's fused expert layout loads with equal
logits, the load-balancing loss and the gradient of loss + coef · aux equal transformers' (the models
and their HF round trips are in test_families.py with the dense families)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from fitlm.models.hf import load_hf_dir
from fitlm.models.loss import cross_entropy_sum
from fitlm.models.moe import load_balancing_loss, moe_layers
from tests.parity.test_families import CASES, COMMON, V, randomize

MOE = [n for n, (t, _, _) in CASES.items() if t in ("qwen3_moe", "qwen2_moe", "mixtral")]


def hf_moe(name: str, tmp_path):
    model_type, overrides, _ = CASES[name]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    cfg._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(cfg).float()
    randomize(hf, seed=11)
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


def ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MOE)
def test_fused_expert_layout_loads_with_equal_logits(name, tmp_path):
    """transformers 5 holds experts fused in memory (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]);
    a checkpoint written from that state dict reads as the per-expert one does."""
    hf, d = hf_moe(name, tmp_path)
    fused = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if k != "lm_head.weight" or not hf.config.tie_word_embeddings
    }
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)  # the layout under test
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_bytes((d / "config.json").read_bytes())
    ours, _ = load_hf_dir(tmp_path / "fused")
    x = ids(24)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), hf.eval()(x).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MOE)
def test_aux_loss_and_its_gradient_equal_transformers(name, tmp_path):
    """fitlm's CE mean + coef · load_balancing_loss over the MoE layers' router logits: the value of
    transformers' `aux_loss` and `loss` (output_router_logits=True) and the same gradients."""
    hf, d = hf_moe(name, tmp_path)
    ours, cfg = load_hf_dir(d)
    hf.router_aux_loss_coef = coef = 0.3  # (read at init from the config) large enough to show in every gradient
    x = ids(24, seed=1)
    labels = torch.roll(x, -1, dims=1)
    labels[:, -1] = -100
    ref = hf.train()(x, labels=x, output_router_logits=True)  # transformers shifts the labels itself
    ref.loss.backward()
    ours.train()
    logits = ours(x)
    layers = moe_layers([ours])
    aux = load_balancing_loss([m.router_logits for m in layers], cfg.num_experts_per_tok)
    loss = cross_entropy_sum(logits, labels) / (labels != -100).sum() + coef * aux
    loss.backward()
    torch.testing.assert_close(aux, ref.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    grads = dict(hf.named_parameters())
    gate = next(n for n, _ in ours.named_parameters() if n.endswith("mlp.gate.weight"))
    hf_gate = gate if gate in grads else gate.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    torch.testing.assert_close(dict(ours.named_parameters())[gate].grad, grads[hf_gate].grad, rtol=1e-4, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(dict(ours.named_parameters())[q].grad, grads[q].grad, rtol=1e-4, atol=1e-6)
