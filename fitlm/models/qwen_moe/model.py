"""Qwen3-MoE (q/k RMSNorm, no biases) and Qwen1.5/Qwen2-MoE (q/k/v biases, a gated shared expert): the
Qwen blocks with a mixture of experts in place of the MLP where `model.sparse_layer(i)`; HF's module names."""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.decoder import DecoderModel, routed_block
from fitlm.models.layers import RMSNorm


class Qwen3MoeForCausalLM(CausalLMMixin, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = partial(routed_block, normalize=bool(cfg.norm_topk_prob), bias=bool(cfg.attention_bias), qk_norm=True)
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))


class Qwen2MoeForCausalLM(CausalLMMixin, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = True if cfg.attention_bias is None else cfg.attention_bias  # HF's qkv_bias, default true
        block = partial(
            routed_block,
            normalize=bool(cfg.norm_topk_prob),
            bias=bias,
            shared_width=cfg.shared_expert_intermediate_size,
        )
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))
