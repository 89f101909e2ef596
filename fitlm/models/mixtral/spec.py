"""The Mixtral family's spec (Mixtral 8x7B, 8x22B and their fine-tunes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitlm.models.family_spec import FamilySpec, llama_ffn
from fitlm.models.qwen_moe.spec import MOE_FEATURES
from fitlm.registry import register_spec

if TYPE_CHECKING:
    from fitlm.config import ModelConfig


def validate(cfg: "ModelConfig") -> list[str]:
    errs = []
    if cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers:
        errs.append("model.decoder_sparse_step: every mixtral block is sparse; leave it 1 and mlp_only_layers empty")
    if cfg.moe_intermediate_size not in (None, cfg.ffn_size):
        errs.append("model.moe_intermediate_size: mixtral's experts are intermediate_size wide; leave it null")
    if cfg.norm_topk_prob is False:
        errs.append("model.norm_topk_prob: mixtral always renormalizes its top-k weights; leave it null")
    if cfg.shared_expert_intermediate_size:
        errs.append("model.shared_expert_intermediate_size: mixtral has no shared expert; set it null")
    if cfg.attention_bias:
        errs.append("model.attention_bias: mixtral has no attention biases")
    if cfg.sliding_window is not None and any(cfg.layer_type(i) == "full" for i in range(cfg.num_layers)):
        errs.append("model.layer_types: mixtral slides every layer when sliding_window is set; leave it null")
    return errs


SPEC = register_spec(
    FamilySpec(
        name="mixtral",
        hf_model_types=("mixtral",),
        default_ffn=llama_ffn,
        validate=validate,
        features=("sliding window", MOE_FEATURES[0], "top-k weights renormalized"),
        moe=True,
    )
)
