"""Llama family: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.

Parameter names are exactly Hugging Face `LlamaForCausalLM`'s (`model.layers.{i}.self_attn.q_proj.weight`,
...), so HF checkpoints load without renaming and LoRA targets read the same everywhere.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.layers import KVCache, RMSNorm, RotaryEmbedding, SelfAttention, attention_inputs, check_inputs, \
    make_blocks
from fitlm.registry import register_model


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, f = cfg.hidden_size, cfg.ffn_size
        self.gate_proj = nn.Linear(c, f, bias=False)
        self.up_proj = nn.Linear(c, f, bias=False)
        self.down_proj = nn.Linear(f, c, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block; the unit that recompute, FSDP and pipeline stages wrap."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,T,C]; cos/sin [B,T,D] from the model's rotary table; attn_mask bool [B,1,T,T] or None (causal)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder blocks and final norm: everything but the output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = make_blocks(LlamaDecoderLayer, cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        start = check_inputs(input_ids, kv_cache, self.config.max_seq_len)
        t = input_ids.shape[1]
        position_ids, mask = attention_inputs(input_ids, position_ids, document_ids, start)  # [B,T], [B,1,T,T]|None
        cos, sin = self.rotary_emb(position_ids)  # [B,T,D] each
        # A pipeline stage without the embedding receives hidden states [B,T,C] instead of ids.
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids  # [B,T,C]
        for layer in self.layers.values():
            h = layer(h, cos, sin, kv_cache, mask)
        if kv_cache is not None:
            kv_cache.advance(t)
        return self.norm(h) if self.norm is not None else h  # [B,T,C]


@register_model("llama")
class LlamaForCausalLM(CausalLMMixin, nn.Module):
    """Llama decoder with a language-model head; state_dict keys match HF `LlamaForCausalLM`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.setup_causal_lm(cfg, LlamaModel(cfg))

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE tables on `device` (default: where they are)."""
        self.model.rotary_emb.reset(device)
