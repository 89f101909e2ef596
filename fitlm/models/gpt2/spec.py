"""The GPT-2 family's spec: what config validation knows of it (no GQA, no RoPE features, 4·hidden MLP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitlm.models.family_spec import FamilySpec
from fitlm.registry import register_spec

if TYPE_CHECKING:
    from fitlm.config import ModelConfig


def _validate(cfg: "ModelConfig") -> list[str]:
    errs = []
    if cfg.num_kv_heads not in (None, cfg.num_heads):
        errs.append("model.num_kv_heads: gpt2 has no grouped-query attention; leave num_kv_heads null")
    for key in ("sliding_window", "rope_scaling", "attn_logit_softcap", "final_logit_softcap", "head_dim"):
        if getattr(cfg, key) is not None:
            errs.append(f"model.{key}: gpt2 has no such feature; leave it null")
    return errs


def _full(i: int) -> str:
    return "full"


def _ffn(hidden: int) -> int:
    return 4 * hidden


SPEC = register_spec(
    FamilySpec(
        name="gpt2",
        hf_model_types=("gpt2",),
        default_ffn=_ffn,
        default_layer_type=_full,
        validate=_validate,
        features=("learned positions, LayerNorm, biases, fused c_attn split on import",),
    )
)
