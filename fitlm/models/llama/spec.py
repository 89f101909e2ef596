"""The Llama family's spec (Llama 1-3.x, Mistral, SmolLM, TinyLlama ...): what config validation knows of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitlm.models.family_spec import FamilySpec, llama_ffn
from fitlm.registry import register_spec

if TYPE_CHECKING:
    from fitlm.config import ModelConfig


def validate(cfg: "ModelConfig") -> list[str]:
    errs = []
    if cfg.sliding_window is not None and any(cfg.layer_type(i) == "full" for i in range(cfg.num_layers)):
        errs.append(
            "model.layer_types: a llama with a sliding window slides every layer (Mistral); leave layer_types null"
        )
    if cfg.sliding_window is not None and cfg.attention_bias:
        errs.append("model.attention_bias: Mistral-style sliding-window llamas have no biases")
    return errs


SPEC = register_spec(
    FamilySpec(
        name="llama",
        hf_model_types=("llama", "mistral"),
        default_ffn=llama_ffn,
        validate=validate,
        features=(
            "RoPE scaling: linear, dynamic, yarn, llama3, longrope",
            "sliding window (Mistral)",
            "optional attention bias",
        ),
    )
)
