"""The Qwen family specs: Qwen2 / Qwen2.5 (`qwen2`) and Qwen3 (`qwen3`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitlm.models.family_spec import FamilySpec, llama_ffn
from fitlm.registry import register_spec

if TYPE_CHECKING:
    from fitlm.config import ModelConfig


def _refuse_bias_off(cfg: "ModelConfig") -> list[str]:
    if cfg.attention_bias is False:
        return ["model.attention_bias: qwen2 always has q/k/v biases; leave it null (or use arch llama)"]
    return []


QWEN2 = register_spec(
    FamilySpec(
        name="qwen2",
        hf_model_types=("qwen2",),
        default_ffn=llama_ffn,
        validate=_refuse_bias_off,
        features=("q/k/v biases",),
    )
)

QWEN3 = register_spec(
    FamilySpec(
        name="qwen3",
        hf_model_types=("qwen3",),
        default_ffn=llama_ffn,
        features=("per-head q/k RMSNorm", "head_dim independent of hidden_size"),
    )
)
