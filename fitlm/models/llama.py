"""Llama family: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.

Parameter names are exactly Hugging Face `LlamaForCausalLM`'s (`model.layers.{i}.self_attn.q_proj.weight`,
...), so HF checkpoints load without renaming and LoRA targets read the same everywhere.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.config import ModelConfig
from fitlm.models.layers import KVCache, RMSNorm, RotaryEmbedding, apply_rotary, causal_attention, check_inputs, \
    default_position_ids
from fitlm.registry import register_model


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        c, h, k = cfg.hidden_size, cfg.num_heads, cfg.kv_heads
        self.q_proj = nn.Linear(c, h * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c, k * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c, k * self.head_dim, bias=False)
        self.o_proj = nn.Linear(h * self.head_dim, c, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # x [B,T,C]
        # Head counts come from the (possibly tensor-parallel-sharded) weights, hence -1, not cfg.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B,H,T,D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B,K,T,D]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B,K,T,D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        start = 0
        if kv_cache is not None:
            start = kv_cache.length
            k, v = kv_cache.update(self.layer_idx, k, v)  # [B,K,S,D]
        out = causal_attention(q, k, v, start)  # [B,H,T,D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B,T,C]


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
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """x [B,T,C]; cos/sin [B,T,D] from the model's rotary table."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder blocks and final norm: everything but the output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        start = check_inputs(input_ids, kv_cache, self.config.max_seq_len)
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = default_position_ids(b, t, start, input_ids.device)  # [B,T]
        cos, sin = self.rotary_emb(position_ids)  # [B,T,D] each
        h = self.embed_tokens(input_ids)  # [B,T,C]
        for layer in self.layers:
            h = layer(h, cos, sin, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(t)
        return self.norm(h)  # [B,T,C]


@register_model("llama")
class LlamaForCausalLM(nn.Module):
    """Llama decoder with a language-model head; state_dict keys match HF `LlamaForCausalLM`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, lm_head.weight is the embedding Parameter itself (one tensor, one grad)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """normal(0, init_std) for linear and embedding weights, ones for norms; deterministic under a seed.

        Also re-ties the head and recomputes the rotary tables, so a model built on the meta device and
        moved with `to_empty(device=...)` becomes usable by calling this (pass buffer_device).
        """
        self.tie_weights()  # `to_empty()` after meta-device construction unties them
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.Linear) and not (module is self.lm_head and self.config.tie_embeddings):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        self.init_buffers(buffer_device)

    reset_parameters = init_weights

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute non-persistent buffers (the RoPE tables) on `device` (default: where they are)."""
        self.model.rotary_emb.reset(device)

    @property
    def output_layer(self) -> nn.Linear:
        return self.lm_head

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B,T] -> final-norm hidden states [B,T,C] (what lm_head consumes)."""
        return self.model(input_ids, position_ids, kv_cache)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B,T] -> logits [B,T,V]."""
        return self.lm_head(self.hidden_states(input_ids, position_ids, kv_cache))

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache sized for this model, on its device and in its dtype."""
        w = self.model.embed_tokens.weight
        return KVCache(self.config.num_layers, batch_size, max_len or self.config.max_seq_len,
                       self.config.kv_heads, self.config.head_dim, w.dtype, w.device)
