"""LoRA on an MoE model's experts against PEFT: fitlm's adapter (one pair per expert under the family's HF names,
fitlm.finetune.expert_lora) loads in PEFT onto the transformers model with fitlm's logits, a PEFT-made per-expert
adapter loads in fitlm with PEFT's logits, and merging it gives the same model. The router stays frozen."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fitlm.finetune.apply import expert_names
from fitlm.finetune.lora import LoraError, apply_lora, inject_lora, merge_lora, split_lora_state_dict
from fitlm.finetune.peft_format import load_adapter, save_adapter
from fitlm.models.hf import load_hf_dir
from fitlm.models.moe import moe_layers
from tests.helpers import PEFT_MAPS, hf_with_adapter
from tests.parity.test_moe import MOE, hf_moe, ids

peft = pytest.importorskip("peft")


def targets(name: str) -> list[str]:
    """Attention and the routed experts. Mixtral's checkpoints name the experts' projections w1/w3/w2. Named by
    their experts' path, not by leaf: a leaf would take a dense layer's or the shared expert's MLP too, which
    PEFT on transformers 5 cannot apply beside the experts (it turns those leaf names into the experts')."""
    if name.startswith("mixtral"):
        return ["q_proj", "w1", "w3", "w2"]
    return ["q_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj"]


def peft_model(hf_dir, adapter_dir):
    """The transformers model read from its checkpoint (as a user loads it) with the adapter, through PEFT."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float()
    return peft.PeftModel.from_pretrained(hf, str(adapter_dir)).eval()


def fitlm_with_adapter(hf_dir, adapter_dir, x, want):
    """fitlm's model of `hf_dir` with the adapter read back (every LoRA tensor placed), its logits on x equal to
    `want`; returns what load_adapter read."""
    spec, tensors = load_adapter(adapter_dir)
    ours, _ = load_hf_dir(hf_dir)
    inject_lora(ours, spec)
    missing, unexpected = ours.load_state_dict(tensors, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), want, rtol=1e-4, atol=1e-4)
    return spec, tensors


def randomized_b(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)


@pytest.mark.parametrize("name", MOE)
def test_fitlm_expert_adapter_loads_in_peft_with_equal_logits(name, tmp_path):
    hf, d = hf_moe(name, tmp_path)
    ours, mcfg = load_hf_dir(d)
    spec = apply_lora(ours, r=3, alpha=6, dropout=0.0, target_modules=targets(name))
    assert any(m.endswith("experts.gate_proj") for m in spec.modules)
    assert not any(m.endswith("mlp.gate") for m in spec.modules)  # the router is not a target
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    randomized_b(ours)
    save_adapter(split_lora_state_dict(ours.state_dict())[1], spec, tmp_path / "adapter", experts=expert_names(mcfg))
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    module = "block_sparse_moe" if name.startswith("mixtral") else "mlp"
    leaf = "w1" if name.startswith("mixtral") else "gate_proj"
    sparse = next(i for i in range(mcfg.num_layers) if mcfg.sparse_layer(i))
    assert f"base_model.model.model.layers.{sparse}.{module}.experts.0.{leaf}.lora_A.weight" in keys  # PEFT's names
    x = ids(20, seed=4)
    with torch.no_grad():
        expected = ours.eval()(x)
        plain = hf.eval()(x).logits
        by_hand = hf_with_adapter(d, tmp_path / "adapter")(x).logits
    assert (expected - plain).abs().max() > 1e-2  # the experts' adapters change the output
    torch.testing.assert_close(by_hand, expected, rtol=1e-4, atol=1e-4)
    if mcfg.arch in PEFT_MAPS:
        with torch.no_grad():
            got = peft_model(d, tmp_path / "adapter")(x).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MOE)
def test_peft_expert_adapter_loads_in_fitlm_and_merges(name, tmp_path):
    """An adapter whose A and B are both trained (random here), in the per-expert layout PEFT writes for
    transformers 4's expert Linears: fitlm reads it back with the logits PEFT (on transformers 5, onto its fused
    experts) or the hand-made transformers model computes, and merging it gives the same model."""
    hf, d = hf_moe(name, tmp_path)
    ours, mcfg = load_hf_dir(d)
    spec = apply_lora(ours, r=2, alpha=4, dropout=0.0, target_modules=targets(name))
    randomized_b(ours)
    for n, p in ours.named_parameters():
        if "lora_A" in n:
            p.data.normal_(0, 0.2)
    save_adapter(split_lora_state_dict(ours.state_dict())[1], spec, tmp_path / "ad", experts=expert_names(mcfg))
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert {t.rsplit(".", 1)[-1] for t in targets(name)} == set(config["target_modules"])
    x = ids(16, seed=7)
    with torch.no_grad():
        reference = peft_model if mcfg.arch in PEFT_MAPS else hf_with_adapter
        want = reference(d, tmp_path / "ad")(x).logits
    loaded_spec, tensors = fitlm_with_adapter(d, tmp_path / "ad", x, want)
    assert set(loaded_spec.modules) == set(spec.modules)
    base, _ = load_hf_dir(d)
    merged = merge_lora(base.state_dict(), tensors, loaded_spec.scaling)
    base.load_state_dict({k: v.to(base.state_dict()[k].dtype) for k, v in merged.items()})
    with torch.no_grad():
        torch.testing.assert_close(base.eval()(x), want, rtol=1e-4, atol=1e-4)


def test_expert_adapters_train_and_switch_off(tmp_path):
    """Gradients reach every expert's A and B (not the router), and adapters_off (DPO's reference) gives the base."""
    from fitlm.finetune.lora import adapters_off

    hf, d = hf_moe(MOE[0], tmp_path)
    ours, _ = load_hf_dir(d)
    x = ids(24, seed=2)
    with torch.no_grad():
        base = ours.eval()(x)
    apply_lora(ours, r=2, alpha=4, dropout=0.0, target_modules=["all-linear"])
    randomized_b(ours)
    ours.train()
    ours(x).float().pow(2).mean().backward()
    experts = moe_layers([ours])[0].experts
    assert experts.lora_A_gate_proj.grad is not None and experts.lora_B_down_proj.grad.abs().sum() > 0
    assert moe_layers([ours])[0].gate.weight.grad is None  # the router is frozen
    with torch.no_grad(), adapters_off(ours):
        torch.testing.assert_close(ours.eval()(x), base)


def test_the_router_is_refused_as_a_target(tmp_path):
    _, d = hf_moe(MOE[0], tmp_path)
    ours, _ = load_hf_dir(d)
    with pytest.raises(LoraError, match="router"):
        apply_lora(ours, r=2, alpha=4, dropout=0.0, target_modules=["gate"])


@pytest.mark.parametrize("name", [n for n in MOE if n.startswith(("qwen3_moe_normalized", "mixtral"))])
@pytest.mark.parametrize("params", [("gate_up_proj", "down_proj"), ("gate_up_proj",), ("down_proj",)])
def test_a_peft_adapter_on_transformers_5s_fused_experts_loads_in_fitlm(name, params, tmp_path):
    """What PEFT writes when it trains on transformers 5's fused experts (`target_parameters`: one pair per
    parameter, all experts in it, nested when both are targeted): fitlm reads it with PEFT's logits."""
    hf, d = hf_moe(name, tmp_path)
    module = "mlp"
    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj"], target_parameters=[f"{module}.experts.{p}" for p in params]
    )
    pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float(), config)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    pm.eval().save_pretrained(str(tmp_path / "fused"))
    x = ids(18, seed=5)
    with torch.no_grad():
        want = pm(x).logits
    fitlm_with_adapter(d, tmp_path / "fused", x, want)
