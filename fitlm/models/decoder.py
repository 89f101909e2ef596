"""The decoder body the RoPE families share: embedding, blocks, final norm, rotary tables.

A family passes its block class (the part that differs: Llama's pre-norm block, Gemma's sandwich of
four norms), its norm factory and whether embeddings are scaled by sqrt(hidden) (Gemma). Layers of
`model.layer_types` "sliding" read the local rotary table when the family has one (Gemma 3's
`rope_local_theta`), the global one otherwise.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import torch
import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.layers import (
    GatedMLP,
    KVCache,
    RMSNorm,
    SelfAttention,
    attention_inputs,
    check_inputs,
    make_blocks,
    shared_mask,
)
from fitlm.models.moe import MoEFeedForward
from fitlm.models.rope import RotaryEmbedding


class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)): Llama, Mistral, Qwen2/3, Phi-3.

    The unit that recompute, FSDP and pipeline stages wrap.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention: SelfAttention, mlp: nn.Module, norm):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = norm(cfg.hidden_size)
        self.self_attn = attention
        self.post_attention_layernorm = norm(cfg.hidden_size)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B,T,C]; cos/sin [B,T,D] from the body's rotary table; attn_mask [B,1,T,T] (bool or additive) or
        None (causal)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def llama_style_block(
    cfg: ModelConfig, layer_idx: int, bias: bool = False, qk_norm: bool = False, fused: bool = False
) -> PreNormBlock:
    """A pre-norm block with Llama's RMSNorm and SwiGLU; the options are what Qwen and Phi-3 change."""
    norm = partial(RMSNorm, eps=cfg.norm_eps)
    attn = SelfAttention(cfg, layer_idx, bias=bias, out_bias=False, qk_norm=norm if qk_norm else None, fused=fused)
    return PreNormBlock(cfg, layer_idx, attn, GatedMLP(cfg, "silu", fused=fused), norm)


def routed_block(
    cfg: ModelConfig,
    layer_idx: int,
    normalize: bool,
    bias: bool = False,
    qk_norm: bool = False,
    shared_width: int | None = None,
) -> PreNormBlock:
    """Llama's pre-norm block whose MLP is a mixture of experts where `cfg.sparse_layer(layer_idx)` (a dense
    SwiGLU of model.intermediate_size elsewhere): Qwen3-MoE, Qwen2-MoE (`shared_width`), Mixtral."""
    norm = partial(RMSNorm, eps=cfg.norm_eps)
    attn = SelfAttention(cfg, layer_idx, bias=bias, out_bias=False, qk_norm=norm if qk_norm else None)
    sparse = cfg.sparse_layer(layer_idx)
    mlp = MoEFeedForward(cfg, normalize, shared_width) if sparse else GatedMLP(cfg, "silu")
    return PreNormBlock(cfg, layer_idx, attn, mlp, norm)


class DecoderModel(nn.Module):
    """Embedding, decoder blocks and final norm: everything but the output projection."""

    def __init__(self, cfg: ModelConfig, block, norm, embed_scale: bool = False):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5 if embed_scale else None
        self.layers = make_blocks(block, cfg)
        self.norm = norm(cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.head_size, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's sliding layers rotate with their own, unscaled base.
        self.rotary_emb_local = (
            RotaryEmbedding(cfg.head_size, cfg.max_seq_len, cast(float, cfg.rope_local_theta))
            if cfg.local_rope  # (which needs rope_local_theta)
            else None
        )
        # Each block's attention type, looked up once (a pipeline stage keeps only its blocks' keys).
        self.layer_rope = {name: cfg.layer_type(int(name)) for name in self.layers}

    def reset_rope(self, device) -> None:
        for rope in (self.rotary_emb, self.rotary_emb_local):
            if rope is not None:
                rope.reset(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        start = check_inputs(input_ids, kv_cache, self.config.max_seq_len)
        t = input_ids.shape[1]
        position_ids, mask = attention_inputs(input_ids, position_ids, document_ids, start)  # [B,T], [B,1,T,T]|None
        rope = {"full": self.rotary_emb(position_ids)}  # (cos, sin), [B,T,D] each
        rope["sliding"] = self.rotary_emb_local(position_ids) if self.rotary_emb_local is not None else rope["full"]
        # A pipeline stage without the embedding receives hidden states [B,T,C] instead of ids.
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids)  # [B,T,C]
            if self.embed_scale is not None:  # in the activation dtype, as Gemma rounds it
                h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        else:
            h = input_ids
        mask = shared_mask(mask, h)  # [B,1,T,T] additive, converted once for every layer (see additive_mask)
        for name, layer in self.layers.items():
            cos, sin = rope[self.layer_rope[name]]
            h = layer(h, cos, sin, kv_cache, mask)
        if kv_cache is not None:
            kv_cache.advance(t)
        return self.norm(h) if self.norm is not None else h  # [B,T,C]
