"""The part every family shares: a body (`self.model`) plus an output projection (`self.lm_head`).

A family class calls `setup_causal_lm(self, cfg, body)` in its `__init__` and gets forward,
hidden_states, weight tying, initialisation and KV-cache construction from `CausalLMMixin`. The
body maps `(input_ids [B,T], position_ids, kv_cache, document_ids=None) -> final-norm hidden states [B,T,C]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.layers import KVCache

if TYPE_CHECKING:
    from fitlm.models.decoder import DecoderModel
    from fitlm.models.gpt2.model import GPT2Model


class CausalLMMixin:
    config: ModelConfig
    model: DecoderModel | GPT2Model
    lm_head: nn.Linear

    def setup_causal_lm(self, cfg: ModelConfig, body: DecoderModel | GPT2Model) -> None:
        self.config = cfg
        self.model = body
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, lm_head.weight is the embedding Parameter itself (one tensor, one grad)."""
        if (
            self.config.tie_embeddings
            and self.lm_head is not None
            and self.model.embed_tokens is not None
            and self.lm_head.weight is not self.model.embed_tokens.weight
        ):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """normal(0, init_std) for linear and embedding weights, zero biases, norms reset; seeded = deterministic.

        Also re-ties the head and recomputes derived buffers, so a model built on the meta device and
        moved with `to_empty(device=...)` becomes usable by calling this (pass buffer_device).
        """
        self.tie_weights()  # `to_empty()` after meta-device construction unties them
        for module in cast(nn.Module, self).modules():  # (every family class is also an nn.Module)
            if module is not self:
                self.init_leaf(module, tied_head=module is self.lm_head and self.config.tie_embeddings)
        self.init_buffers(buffer_device)

    @torch.no_grad()
    def init_leaf(self, module: nn.Module, tied_head: bool = False) -> None:
        """One module's share of `init_weights` (fitlm.models.init_replay replays it module by module)."""
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, self.config.init_std)
        elif isinstance(module, nn.Linear):
            if not tied_head:
                nn.init.normal_(module.weight, 0.0, self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif hasattr(module, "reset_parameters") and not list(module.children()):
            # norms: ones (and zero bias for LayerNorm)
            module.reset_parameters()  # type: ignore[operator]  # (hasattr above)

    def reset_parameters(self, buffer_device: torch.device | str | None = None) -> None:
        self.init_weights(buffer_device)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute non-persistent buffers (the RoPE tables, where the body has them)."""
        if hasattr(self.model, "reset_rope"):
            self.model.reset_rope(device)  # type: ignore[operator]  # (hasattr above: DecoderModel's)
        # aux-free balancing's routing bias (fitlm.models.moe): zero, outside the weights
        for m in self.modules():  # type: ignore[attr-defined]  # (mixed into an nn.Module)
            if hasattr(m, "reset_expert_bias"):
                m.reset_expert_bias(device)

    @property
    def output_layer(self) -> nn.Linear:
        return self.lm_head

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B,T] -> final-norm hidden states [B,T,C] (what lm_head consumes).

        document_ids [B,T] (ints, equal within one packed document of a row) makes attention
        block-causal: no token attends across a document boundary. position_ids then default to
        restarting at 0 per document. Without document_ids attention is plain causal (is_causal SDPA).
        """
        if document_ids is None:  # keep the call exactly as before for hooks/wrappers that read args
            return self.model(input_ids, position_ids, kv_cache)
        return self.model(input_ids, position_ids, kv_cache, document_ids=document_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B,T] -> logits [B,T,V] (hidden states [B,T,C] on a pipeline stage without the head).
        document_ids: see `hidden_states`."""
        h = self.hidden_states(input_ids, position_ids, kv_cache, document_ids=document_ids)
        return h if self.lm_head is None else self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [..., C] -> logits [..., V]: the head, then Gemma 2's soft cap (bounded
        logits), as forward computes them; decoding and scoring call it on the positions they need."""
        logits = self.lm_head(h)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache sized for this model, on its device and in its dtype."""
        w = self.model.embed_tokens.weight
        return KVCache(
            self.config.num_layers,
            batch_size,
            max_len or self.config.max_seq_len,
            self.config.kv_heads,
            self.config.head_size,
            w.dtype,
            w.device,
        )


if TYPE_CHECKING:

    class CausalLM(CausalLMMixin, nn.Module):
        """The static type of every family's model (CausalLMMixin + nn.Module): what code that receives one
        as an nn.Module casts it to before reading `config`, `model.layers`, `lm_head` and the like."""
