"""Phi-3 config.json <-> ModelConfig (weights keep HF's fused names)."""

from __future__ import annotations

from typing import Any, Mapping

from fitlm.config import ModelConfig
from fitlm.models.hf import normalized, refuse, rope_family_config, rope_family_config_to_hf


def config_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    cfg = rope_family_config(hf, "phi3", problems, lambda i: "sliding")  # a set window slides every layer
    refuse(problems, source)
    return normalized(cfg)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = {**rope_family_config_to_hf(cfg, "phi3"), "hidden_act": "silu", "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    if cfg.rope_scaling is not None and cfg.rope_scaling.original_max_seq_len:
        out["original_max_position_embeddings"] = cfg.rope_scaling.original_max_seq_len
    out.pop("layer_types")  # Phi-3's config has none: its window applies to every layer
    return out
