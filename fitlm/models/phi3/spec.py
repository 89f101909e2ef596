"""The Phi-3 family's spec (Phi-3-mini/medium, Phi-3.5-mini)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitlm.models.family_spec import FamilySpec, llama_ffn
from fitlm.registry import register_spec

if TYPE_CHECKING:
    from fitlm.config import ModelConfig


def _layer_types_uniform(cfg: "ModelConfig") -> list[str]:
    if cfg.sliding_window is not None and len({cfg.layer_type(i) for i in range(cfg.num_layers)}) > 1:
        return ["model.layer_types: phi3 slides every layer or none; leave layer_types null"]
    return []


SPEC = register_spec(
    FamilySpec(
        name="phi3",
        hf_model_types=("phi3",),
        default_ffn=llama_ffn,
        validate=_layer_types_uniform,
        features=("fused qkv_proj and gate_up_proj (HF/PEFT names)", "LongRoPE"),
    )
)
