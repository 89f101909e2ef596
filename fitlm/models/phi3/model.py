"""Phi-3 / Phi-3.5-mini: Llama's block with HF's fused projections kept as they are stored --
`self_attn.qkv_proj` [(H+2K)·D, C] and `mlp.gate_up_proj` [2F, C] -- so a LoRA on `qkv_proj` is a
PEFT adapter on the same matrix. LongRoPE (128k variants, Phi-3.5) comes from `model.rope_scaling`."""

from __future__ import annotations

from functools import partial
from typing import Iterable, cast

import torch
import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.causal_lm import CausalLMMixin
from fitlm.models.decoder import DecoderModel, PreNormBlock, llama_style_block
from fitlm.models.hf import StateDict
from fitlm.models.layers import RMSNorm


class Phi3ForCausalLM(CausalLMMixin, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = partial(llama_style_block, fused=True)
        self.setup_causal_lm(cfg, DecoderModel(cfg, block, partial(RMSNorm, eps=cfg.norm_eps)))


def _split_linear(parent: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Replace parent.<fused> by one Linear per part (rows in order), weights copied (or kept on meta)."""
    old = getattr(parent, fused)
    rows = old.weight.split(list(parts.values()), dim=0)
    for (name, n), w in zip(parts.items(), rows):
        lin = nn.Linear(old.in_features, n, bias=False, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            lin.weight = nn.Parameter(w.clone(), requires_grad=old.weight.requires_grad)
        setattr(parent, name, lin)
    delattr(parent, fused)


def split_fused(model: nn.Module) -> None:
    """Before tensor parallel: a contiguous row shard of [q; k; v] would give a rank queries of some heads and
    keys of others, so the fused projections become separate q/k/v and gate/up Linears that shard by heads
    and MLP columns. The forward is unchanged (it reads whichever form the module has); `fuse_state_dict`
    restores HF's fused names when the weights are saved."""
    lm = cast(Phi3ForCausalLM, model)  # (the family's prepare_tensor_parallel hook: a Phi-3 model)
    cfg = lm.config
    d = cfg.head_size
    for block in cast(Iterable[PreNormBlock], lm.model.layers.values()):  # (llama_style_block's)
        if hasattr(block.self_attn, "qkv_proj"):
            _split_linear(
                block.self_attn,
                "qkv_proj",
                {"q_proj": cfg.num_heads * d, "k_proj": cfg.kv_heads * d, "v_proj": cfg.kv_heads * d},
            )
        if hasattr(block.mlp, "gate_up_proj"):
            _split_linear(block.mlp, "gate_up_proj", {"gate_proj": cfg.ffn_size, "up_proj": cfg.ffn_size})


def split_state_dict(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """Fused weights under the names `split_fused` gives (what a model split before sharding loads)."""
    d, out = cfg.head_size, {}
    parts = {
        "self_attn.qkv_proj.weight": {
            "self_attn.q_proj.weight": cfg.num_heads * d,
            "self_attn.k_proj.weight": cfg.kv_heads * d,
            "self_attn.v_proj.weight": cfg.kv_heads * d,
        },
        "mlp.gate_up_proj.weight": {"mlp.gate_proj.weight": cfg.ffn_size, "mlp.up_proj.weight": cfg.ffn_size},
    }
    for key, t in sd.items():
        fused = next((f for f in parts if key.endswith(f)), None)
        if fused is None:
            out[key] = t
            continue
        prefix = key.removesuffix(fused)
        for (name, _), rows in zip(parts[fused].items(), t.split(list(parts[fused].values()), dim=0)):
            out[prefix + name] = rows
    return out


def fuse_state_dict(sd: StateDict) -> StateDict:
    """Weights of a split model (tensor parallel runs) under HF's fused names; a fused state dict passes."""
    out = dict(sd)
    for key in [k for k in sd if k.endswith("self_attn.q_proj.weight")]:
        p = key.removesuffix("q_proj.weight")
        out[p + "qkv_proj.weight"] = torch.cat([out.pop(p + f"{n}_proj.weight") for n in "qkv"], dim=0)
    for key in [k for k in sd if k.endswith("mlp.gate_proj.weight")]:
        p = key.removesuffix("gate_proj.weight")
        out[p + "gate_up_proj.weight"] = torch.cat([out.pop(p + "gate_proj.weight"), out.pop(p + "up_proj.weight")])
    return out
