"""Llama family: RMSNorm, rotary positions (with Llama 3's frequency scaling), grouped-query attention,
SwiGLU MLP. Mistral is the same module with sliding-window attention (`model.sliding_window`).

Parameter names are exactly Hugging Face `LlamaForCausalLM`'s (`model.layers.{i}.self_attn.q_proj.weight`,
...), so HF checkpoints load without renaming and LoRA targets read the same everywhere.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.decoder import DecoderModel, llama_style_block
from fitlm.models.layers import RMSNorm


class LlamaForCausalLM(CausalLMMixin, nn.Module):
    """Llama decoder with a language-model head; state_dict keys match HF `LlamaForCausalLM`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = partial(llama_style_block, bias=bool(cfg.attention_bias))
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))
