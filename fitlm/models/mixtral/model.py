"""Mixtral: Mistral's attention (every layer slides when sliding_window is set) with a mixture of experts in
every block, top-k weights always renormalized. HF's module names, with `mlp` for its `block_sparse_moe`."""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.decoder import DecoderModel, routed_block
from fitlm.models.layers import RMSNorm


class MixtralForCausalLM(CausalLMMixin, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = partial(routed_block, normalize=True)
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))
