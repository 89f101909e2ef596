"""Mixtral config.json <-> ModelConfig; weights through fitlm.models.moe_hf (`block_sparse_moe`, w1/w3/w2)."""

from __future__ import annotations

from typing import Any, Mapping

from fitlm.config import ModelConfig
from fitlm.models.hf import StateDict, normalized, refuse, rope_family_config, rope_family_config_to_hf
from fitlm.models.moe_hf import ExpertNames, experts_from_hf, experts_to_hf

NAMES = ExpertNames(module="block_sparse_moe", gate="w1", up="w3", down="w2")


def config_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']} (training-time input noise of the router)")
    cfg = rope_family_config(
        hf,
        "mixtral",
        problems,
        lambda i: "sliding",
        num_experts=int(hf.get("num_local_experts", 8)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )
    refuse(problems, source)
    return normalized(cfg)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **rope_family_config_to_hf(cfg, "mixtral"),
        "hidden_act": "silu",
        "intermediate_size": cfg.expert_ffn_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def to_hf(sd: StateDict, cfg: ModelConfig, source: str = "state dict") -> StateDict:
    return experts_to_hf(sd, cfg, NAMES, source)


def from_hf(sd: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    return experts_from_hf(sd, cfg, NAMES, source)
