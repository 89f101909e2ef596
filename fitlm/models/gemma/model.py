"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), GeGLU (tanh), a
sandwich of pre- and post-norms around attention and MLP, alternating sliding-window / global
layers, score scale query_pre_attn_scalar^-1/2; Gemma 2 soft-caps attention scores and logits,
Gemma 3 norms q and k per head and rotates its sliding layers with a local base (rope_local_theta).
Names are HF's `Gemma2ForCausalLM` / `Gemma3ForCausalLM`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.decoder import DecoderModel
from fitlm.models.layers import GatedMLP, KVCache, RMSNorm, SelfAttention


class GemmaBlock(nn.Module):
    """x + post_norm(attn(norm(x))), then the same around the MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        norm = partial(RMSNorm, eps=cfg.norm_eps, unit_offset=True)
        c = cfg.hidden_size
        self.input_layernorm = norm(c)
        self.self_attn = SelfAttention(cfg, layer_idx, bias=bool(cfg.attention_bias), qk_norm=norm if qk_norm else None)
        self.post_attention_layernorm = norm(c)
        self.pre_feedforward_layernorm = norm(c)
        self.mlp = GatedMLP(cfg, "gelu_tanh")
        self.post_feedforward_layernorm = norm(c)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B,T,C] -> [B,T,C]; cos/sin [B,T,D] of this layer's attention type."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Gemma(CausalLMMixin, nn.Module):
    QK_NORM = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = partial(GemmaBlock, qk_norm=self.QK_NORM)
        body = DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps, unit_offset=True), embed_scale=True)
        self.setup_causal_lm(cfg, body)


class Gemma2ForCausalLM(_Gemma):
    QK_NORM = False


class Gemma3ForCausalLM(_Gemma):
    QK_NORM = True
