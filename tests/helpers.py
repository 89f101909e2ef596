"""Helpers shared by test modules of more than one tier (unit, parity)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from fitlm.finetune.lora import LoraError, LoraSpec, inject_lora
from fitlm.finetune.peft_format import load_adapter


def attach_adapter(model: nn.Module, adapter_dir: str | Path) -> LoraSpec:
    """Inject a saved PEFT LoRA adapter (fitlm's or one made elsewhere) into a plain fitlm model, unmerged: the
    PEFT parity tests compare its forward with peft's; fitlm itself only ever merges adapters (fitlm merge)."""
    spec, tensors = load_adapter(adapter_dir)
    params = dict(model.named_parameters())
    for m in spec.modules:
        w = params.get(f"{m}.weight")
        a, b = tensors[f"{m}.lora_A.weight"], tensors[f"{m}.lora_B.weight"]
        if w is None or tuple(w.shape) != (b.shape[0], a.shape[1]):
            have = tuple(w.shape) if w is not None else "missing"
            raise LoraError(
                f"{adapter_dir}: adapts {m} as {(b.shape[0], a.shape[1])} but this model's {m} is "
                f"{have}: the adapter was made for another base model"
            )
    inject_lora(model, spec)
    dev = next(model.parameters()).device
    missing, unexpected = model.load_state_dict({k: v.to(dev) for k, v in tensors.items()}, strict=False)
    if unexpected:
        raise LoraError(f"{adapter_dir}: tensors {unexpected[:3]} do not fit the model")
    return spec


def hf_with_adapter(hf_dir, adapter_dir) -> torch.nn.Module:
    """The transformers model with every LoRA pair of a PEFT adapter added to its weights by hand: W + s·B·A on
    each Linear, and on each expert's rows of the fused experts (gate_up_proj [E, 2I, H]: gate rows first;
    down_proj [E, H, I]): what the adapter means on transformers 4's per-expert Linears."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    s = cfg["lora_alpha"] / cfg["r"]
    pairs = load_file(adapter_dir / "adapter_model.safetensors")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for k, a in pairs.items():
            if ".lora_A." not in k:
                continue
            delta = s * pairs[k.replace(".lora_A.", ".lora_B.")] @ a
            module = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            expert = re.match(r"(.+\.experts)\.(\d+)\.(\w+)$", module)
            if expert is None:
                params[f"{module}.weight"] += delta
                continue
            stack, e, leaf = expert[1].replace("block_sparse_moe", "mlp"), int(expert[2]), expert[3]
            if leaf in ("down_proj", "w2"):
                params[f"{stack}.down_proj"][e] += delta
            else:  # gate (gate_proj, w1) then up (up_proj, w3)
                rows = delta.shape[0]
                half = slice(0, rows) if leaf in ("gate_proj", "w1") else slice(rows, 2 * rows)
                params[f"{stack}.gate_up_proj"][e, half] += delta
    return hf


# PEFT 0.21 on transformers 5 maps a per-expert adapter onto the fused experts of these (it converts the targets
# gate_proj/up_proj/down_proj into target_parameters); on Qwen2-MoE it wraps no expert (the conversion leaves its
# experts without an adapter), so there the hand-made transformers model is the only reference.
PEFT_MAPS = ("qwen3_moe", "mixtral")


def peft_applies(mcfg) -> bool:
    """PEFT 0.21 on transformers 5 applies an all-linear adapter of this model as fitlm does: its family's experts
    map onto the fused ones, and no dense block or shared expert shares their leaf names."""
    dense = any(not mcfg.sparse_layer(i) for i in range(mcfg.num_layers))
    return mcfg.arch in PEFT_MAPS and not dense and not mcfg.shared_expert_intermediate_size
