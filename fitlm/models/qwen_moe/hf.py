"""Qwen3-MoE and Qwen2-MoE config.json <-> ModelConfig; weights through fitlm.models.moe_hf."""

from __future__ import annotations

from typing import Any, Mapping

from fitlm.config import ModelConfig
from fitlm.models.hf import StateDict
from fitlm.models.moe_hf import ExpertNames, experts_from_hf, experts_to_hf
from fitlm.models.qwen.hf import qwen_config, qwen_config_to_hf

NAMES = ExpertNames()


def moe_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The routing fields both Qwen MoE configs spell alike (HF defaults where a key is absent)."""
    return dict(
        # transformers 5 writes num_local_experts (its attribute map), 4.x num_experts
        num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0) or None,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 4)),
        moe_intermediate_size=hf.get("moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.expert_ffn_size,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }


def qwen3_moe_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    return qwen_config(hf, source, "qwen3_moe", True if hf.get("attention_bias") else None, **moe_from_hf(hf))


def qwen2_moe_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    # transformers 4.x has no qkv_bias key: its Qwen2-MoE always has q/k/v biases.
    bias = None if hf.get("qkv_bias", True) else False
    shared = hf.get("shared_expert_intermediate_size", 5632)  # transformers' default: every Qwen2-MoE has one
    return qwen_config(hf, source, "qwen2_moe", bias, shared_expert_intermediate_size=shared or None, **moe_from_hf(hf))


def qwen3_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**qwen_config_to_hf(cfg, "qwen3_moe"), **moe_to_hf(cfg), "attention_bias": bool(cfg.attention_bias)}


def qwen2_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **qwen_config_to_hf(cfg, "qwen2_moe"),
        **moe_to_hf(cfg),
        "qkv_bias": cfg.attention_bias is not False,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }


def to_hf(sd: StateDict, cfg: ModelConfig, source: str = "state dict") -> StateDict:
    return experts_to_hf(sd, cfg, NAMES, source)


def from_hf(sd: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    return experts_from_hf(sd, cfg, NAMES, source)
