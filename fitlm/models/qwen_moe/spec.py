"""The Qwen mixture-of-experts family specs: Qwen3-MoE (`qwen3_moe`) and Qwen1.5/Qwen2-MoE (`qwen2_moe`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitlm.models.family_spec import FamilySpec, llama_ffn
from fitlm.registry import register_spec

if TYPE_CHECKING:
    from fitlm.config import ModelConfig

MOE_FEATURES = ("mixture of experts: fp32 top-k router, stacked experts, dropless", "dense layers among sparse ones")


def _no_shared_expert(cfg: "ModelConfig") -> list[str]:
    if cfg.shared_expert_intermediate_size:
        return ["model.shared_expert_intermediate_size: qwen3_moe has no shared expert (qwen2_moe has); set it null"]
    return []


def _needs_shared_expert(cfg: "ModelConfig") -> list[str]:
    if not cfg.shared_expert_intermediate_size:
        return ["model.shared_expert_intermediate_size: every qwen2_moe has a shared expert; give its width (e.g. 4·I)"]
    return []


QWEN3_MOE = register_spec(
    FamilySpec(
        name="qwen3_moe",
        hf_model_types=("qwen3_moe",),
        default_ffn=llama_ffn,
        validate=_no_shared_expert,
        features=("per-head q/k RMSNorm", *MOE_FEATURES),
        moe=True,
    )
)

QWEN2_MOE = register_spec(
    FamilySpec(
        name="qwen2_moe",
        hf_model_types=("qwen2_moe",),
        default_ffn=llama_ffn,
        validate=_needs_shared_expert,
        features=("q/k/v biases", "sigmoid-gated shared expert", *MOE_FEATURES),
        moe=True,
    )
)
