"""Qwen2/2.5 and Qwen3 config.json <-> ModelConfig (weights keep HF's names)."""

from __future__ import annotations

from typing import Any, Mapping

from fitlm.config import ModelConfig
from fitlm.models.hf import normalized, refuse, rope_family_config, rope_family_config_to_hf


def qwen_config(hf: Mapping[str, Any], source: str, arch: str, bias: bool | None, **extra: Any) -> ModelConfig:
    """A Qwen config.json (dense or MoE: `extra` are the routing fields) as a ModelConfig, or refused."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    # transformers 4.x: layers from max_window_layers on slide when use_sliding_window is set.
    slides, first = bool(hf.get("use_sliding_window")), int(hf.get("max_window_layers") or 0)
    hf = dict(hf) if slides else {**hf, "sliding_window": None}
    cfg = rope_family_config(
        hf, arch, problems, lambda i: "sliding" if slides and i >= first else "full", attention_bias=bias, **extra
    )
    refuse(problems, source)
    return normalized(cfg)


def qwen2_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    return qwen_config(hf, source, "qwen2", None)


def qwen3_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    return qwen_config(hf, source, "qwen3", True if hf.get("attention_bias") else None)


def qwen_config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    sliding = cfg.sliding_window is not None
    out = {
        **rope_family_config_to_hf(cfg, model_type),
        "hidden_act": "silu",
        "use_sliding_window": sliding,
        "max_window_layers": next((i for i in range(cfg.num_layers) if cfg.layer_type(i) == "sliding"), cfg.num_layers),
    }
    return out


def qwen2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return qwen_config_to_hf(cfg, "qwen2")


def qwen3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**qwen_config_to_hf(cfg, "qwen3"), "attention_bias": bool(cfg.attention_bias)}
