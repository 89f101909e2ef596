"""Llama and Mistral config.json <-> ModelConfig (the weights carry HF's names unchanged)."""

from __future__ import annotations

from typing import Any, Mapping

from fitlm.config import ModelConfig
from fitlm.models.hf import normalized, refuse, rope_family_config, rope_family_config_to_hf


def config_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true (the Llama MLP here has no biases)")
    # Mistral slides every layer when sliding_window is set; Llama never slides.
    slides = hf.get("model_type") == "mistral"
    cfg = rope_family_config(
        hf,
        "llama",
        problems,
        lambda i: "sliding" if slides else "full",
        attention_bias=bool(hf.get("attention_bias")) or None,
    )
    refuse(problems, source)
    return normalized(cfg)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.sliding_window is not None:  # transformers' Llama has no window: Mistral is the same model with one
        return {
            **rope_family_config_to_hf(cfg, "mistral"),
            "architectures": ["MistralForCausalLM"],
            "hidden_act": "silu",
        }
    return {
        **rope_family_config_to_hf(cfg, "llama"),
        "hidden_act": "silu",
        "attention_bias": bool(cfg.attention_bias),
        "mlp_bias": False,
    }
