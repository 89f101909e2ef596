"""GPT-2 family: learned positions, LayerNorm with bias, tanh-GELU MLP, biased linears, plain MHA.

Internal names follow the Llama layout so LoRA targets and tooling are uniform across families:

    model.embed_tokens        (HF transformer.wte)
    model.embed_positions     (HF transformer.wpe)
    model.layers.{i}.input_layernorm           (ln_1)
    model.layers.{i}.self_attn.{q,k,v}_proj    (the three thirds of attn.c_attn, fused in HF)
    model.layers.{i}.self_attn.o_proj          (attn.c_proj)
    model.layers.{i}.post_attention_layernorm  (ln_2)
    model.layers.{i}.mlp.up_proj               (mlp.c_fc)
    model.layers.{i}.mlp.down_proj             (mlp.c_proj)
    model.norm                (transformer.ln_f)
    lm_head                   (lm_head, usually tied to the token embedding)

HF stores the linears as Conv1D ([in, out]); `fitlm.models.gpt2.hf` transposes and splits on conversion.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.layers import KVCache, SelfAttention, attention_inputs, check_inputs, make_blocks, shared_mask


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.down_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The tanh approximation is what GPT-2 was trained with (HF "gelu_new").
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class GPT2Block(nn.Module):
    """One pre-norm transformer block; the unit that recompute, FSDP and pipeline stages wrap."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx, bias=True)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(
        self, x: torch.Tensor, kv_cache: KVCache | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B,T,C] -> [B,T,C]; attn_mask [B,1,T,T] (bool or additive) or None (causal)."""
        x = x + self.self_attn(self.input_layernorm(x), kv_cache=kv_cache, attn_mask=attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT2Model(nn.Module):
    """Embeddings, blocks and final norm: everything but the output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.layers = make_blocks(GPT2Block, cfg)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

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
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)  # [B,T,C]
        else:  # a later pipeline stage: hidden states [B,T,C] come in
            h = input_ids
        mask = shared_mask(mask, h)  # [B,1,T,T] additive, converted once for every layer (see additive_mask)
        for layer in self.layers.values():
            h = layer(h, kv_cache, mask)
        if kv_cache is not None:
            kv_cache.advance(t)
        return self.norm(h) if self.norm is not None else h  # [B,T,C]


class GPT2LMHeadModel(CausalLMMixin, nn.Module):
    """GPT-2 with a language-model head. Same interface as `LlamaForCausalLM`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.setup_causal_lm(cfg, GPT2Model(cfg))
