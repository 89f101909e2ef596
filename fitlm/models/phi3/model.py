"""Phi-3 / Phi-3.5-mini: Llama's block with HF's fused projections kept as they are stored --
`self_attn.qkv_proj` [(H+2K)·D, C] and `mlp.gate_up_proj` [2F, C] -- so a LoRA on `qkv_proj` is a
PEFT adapter on the same matrix. LongRoPE (128k variants, Phi-3.5) comes from `model.rope_scaling`."""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.decoder import DecoderModel, llama_style_block
from fitlm.models.layers import RMSNorm


class Phi3ForCausalLM(CausalLMMixin, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = partial(llama_style_block, fused=True)
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))
