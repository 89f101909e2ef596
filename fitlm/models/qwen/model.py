"""Qwen2 / Qwen2.5 (biases on q/k/v) and Qwen3 (per-head RMSNorm on q and k, head_dim set freely):
Llama's pre-norm block with those two options; names are HF's `Qwen2ForCausalLM` / `Qwen3ForCausalLM`."""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.decoder import DecoderModel, llama_style_block
from fitlm.models.layers import RMSNorm


class Qwen2ForCausalLM(CausalLMMixin, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Qwen2 always has q/k/v biases (its config has no switch); o_proj has none.
        bias = True if cfg.attention_bias is None else cfg.attention_bias
        block = partial(llama_style_block, bias=bias)
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))


class Qwen3ForCausalLM(CausalLMMixin, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = partial(llama_style_block, bias=bool(cfg.attention_bias), qk_norm=True)
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))
