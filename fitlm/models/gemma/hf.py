"""Gemma 2 and Gemma 3 (text) config.json <-> ModelConfig (weights keep HF's names)."""

from __future__ import annotations

from typing import Any, Mapping

from fitlm.config import ModelConfig
from fitlm.models.gemma.spec import gemma2_layer_type, gemma3_layer_type
from fitlm.models.hf import (
    normalized,
    refuse,
    rope_family_config,
    rope_family_config_to_hf,
    rope_from_hf,
    rope_to_hf,
    same_names_from_hf,
)


def _config(hf: Mapping[str, Any], source: str, arch: str) -> ModelConfig:
    problems = []
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        problems.append(f"hidden_activation={act!r} (only the tanh GELU)")
    if arch == "gemma3":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        default = lambda i: gemma3_layer_type(i, pattern)  # noqa: E731
        if isinstance((hf.get("rope_parameters") or {}).get("sliding_attention"), Mapping):  # transformers 5
            local_theta, local_scaling = rope_from_hf(hf, problems, "sliding_attention")
            if local_scaling is not None:
                problems.append("RoPE scaling on the sliding-window layers (only the global layers are scaled)")
        else:  # transformers 4.x
            local_theta = float(hf.get("rope_local_base_freq", 10000.0))
        extra = {"rope_local_theta": local_theta}
    else:
        default, extra = gemma2_layer_type, {}
    caps = {
        "attn_logit_softcap": hf.get("attn_logit_softcapping"),
        "final_logit_softcap": hf.get("final_logit_softcapping"),
    }
    cfg = rope_family_config(
        {"tie_word_embeddings": True, **hf},
        arch,
        problems,
        default,
        attention_bias=bool(hf.get("attention_bias")) or None,
        query_pre_attn_scalar=int(hf["query_pre_attn_scalar"]) if hf.get("query_pre_attn_scalar") else None,
        **{k: float(v) for k, v in caps.items() if v},
        **extra,
    )
    refuse(problems, source)
    return normalized(cfg)


def gemma2_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    return _config(hf, source, "gemma2")


def gemma3_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    if isinstance(hf.get("text_config"), Mapping):  # Gemma3ForConditionalGeneration (4B and up): its language model
        hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf["text_config"]}
    return _config(hf, source, "gemma3")


_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def gemma3_from_hf_state_dict(sd, cfg: ModelConfig, source: str):
    """The language model of a Gemma 3 checkpoint: text-only names as they are; a multimodal checkpoint's
    `language_model.model.*` (or transformers 5's `model.language_model.*`) renamed, its vision tower and
    projector left out -- fitlm trains and serves the text model."""
    out = {}
    for k, v in sd.items():
        if k.startswith(_VISION):
            continue
        for prefix, repl in (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),
        ):
            if k.startswith(prefix):
                k = repl + k[len(prefix) :]
                break
        out[k] = v
    return same_names_from_hf(out, cfg, source)


def _to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    return {
        **rope_family_config_to_hf(cfg, model_type),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "attention_bias": bool(cfg.attention_bias),
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_size,
        "attn_logit_softcapping": cfg.attn_logit_softcap,
        "final_logit_softcapping": cfg.final_logit_softcap,
    }


def gemma2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return _to_hf(cfg, "gemma2")


def gemma3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    local = cfg.rope_local_theta or cfg.rope_theta
    out = _to_hf(cfg, "gemma3_text")
    # transformers 5 keeps one RoPE entry per attention type; 4.x reads rope_local_base_freq.
    out["rope_parameters"] = {
        "full_attention": rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
        "sliding_attention": rope_to_hf(local, None),
    }
    out["rope_local_base_freq"] = local
    return out
