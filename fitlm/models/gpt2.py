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

HF stores the linears as Conv1D ([in, out]); `fitlm.models.hf` transposes and splits on conversion.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.config import ModelConfig
from fitlm.models.layers import KVCache, causal_attention, check_inputs, default_position_ids
from fitlm.registry import register_model


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        c = cfg.hidden_size
        self.q_proj = nn.Linear(c, c)
        self.k_proj = nn.Linear(c, c)
        self.v_proj = nn.Linear(c, c)
        self.o_proj = nn.Linear(c, c)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # x [B,T,C]
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B,H,T,D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B,H,T,D]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B,H,T,D]
        start = 0
        if kv_cache is not None:
            start = kv_cache.length
            k, v = kv_cache.update(self.layer_idx, k, v)  # [B,H,S,D]
        out = causal_attention(q, k, v, start)  # [B,H,T,D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B,T,C]


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
        self.self_attn = GPT2Attention(cfg, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """x [B,T,C] -> [B,T,C]."""
        x = x + self.self_attn(self.input_layernorm(x), kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT2Model(nn.Module):
    """Embeddings, blocks and final norm: everything but the output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.layers = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        start = check_inputs(input_ids, kv_cache, self.config.max_seq_len)
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = default_position_ids(b, t, start, input_ids.device)  # [B,T]
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)  # [B,T,C]
        for layer in self.layers:
            h = layer(h, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(t)
        return self.norm(h)  # [B,T,C]


@register_model("gpt2")
class GPT2LMHeadModel(nn.Module):
    """GPT-2 with a language-model head. Same interface as `LlamaForCausalLM`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.num_kv_heads not in (None, cfg.num_heads):
            raise ValueError("model.num_kv_heads: gpt2 has no grouped-query attention; leave num_kv_heads null")
        self.config = cfg
        self.model = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, lm_head.weight is the token-embedding Parameter itself."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """normal(0, init_std) for linear and embedding weights, zero biases, LayerNorm = identity."""
        self.tie_weights()  # `to_empty()` after meta-device construction unties them
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.Linear):
                if not (module is self.lm_head and self.config.tie_embeddings):
                    nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        self.init_buffers(buffer_device)

    reset_parameters = init_weights

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """GPT-2 has no derived buffers; present so every family can be built on the meta device alike."""

    @property
    def output_layer(self) -> nn.Linear:
        return self.lm_head

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B,T] -> final-norm hidden states [B,T,C]."""
        return self.model(input_ids, position_ids, kv_cache)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B,T] -> logits [B,T,V]."""
        return self.lm_head(self.hidden_states(input_ids, position_ids, kv_cache))

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache sized for this model, on its device and in its dtype."""
        w = self.model.embed_tokens.weight
        return KVCache(self.config.num_layers, batch_size, max_len or self.config.max_seq_len,
                       self.config.num_heads, self.config.head_dim, w.dtype, w.device)
