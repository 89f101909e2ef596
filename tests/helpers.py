"""Helpers shared by test modules of more than one tier (unit, parity)."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

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
