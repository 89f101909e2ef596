"""Hugging Face layouts of stacked experts, for the MoE families' state-dict adapters.

fitlm keeps a layer's experts stacked: `mlp.experts.{gate,up,down}_proj` [E, I, H] / [E, H, I]. Hugging Face
stores them two ways, both read here:
  - one tensor per expert, what `save_pretrained` writes: `<moe>.experts.<e>.<name>.weight` (Qwen:
    gate_proj/up_proj/down_proj under `mlp`; Mixtral: w1/w3/w2 under `block_sparse_moe`);
  - transformers 5's fused in-memory layout: `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
    `mlp.experts.down_proj` [E, H, I];
and fitlm's own stacked names (what a GGUF file's ffn_*_exps tensors are read back as).
Export writes the per-expert layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fitlm.config import ModelConfig
from fitlm.models.hf import StateDict, head_from_hf, head_to_hf, model_keys, take

_EXPERT = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_MLP = re.compile(r"^(model\.layers\.\d+\.)mlp\.")


@dataclass(frozen=True)
class ExpertNames:
    """How a family's checkpoints name an MoE layer: the feed-forward module (`mlp`, Mixtral's
    `block_sparse_moe`) and each expert projection (fitlm's gate_proj/up_proj/down_proj -> HF's)."""

    module: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def expert(self, layer: str, e: int, proj: str) -> str:
        return f"{layer}{self.module}.experts.{e}.{getattr(self, proj.removesuffix('_proj'))}.weight"

    def outside(self, cfg: ModelConfig, name: str) -> str:
        """The HF name of a non-expert weight: a sparse layer's router and shared expert live in `module`."""
        m = _MLP.match(name)
        if m and self.module != "mlp" and cfg.sparse_layer(int(m.group(1).split(".")[2])):
            return f"{m.group(1)}{self.module}.{name[m.end() :]}"
        return name


def experts_to_hf(sd: StateDict, cfg: ModelConfig, names: ExpertNames, source: str = "state dict") -> StateDict:
    """fitlm names (stacked experts) -> HF's per-expert layout; a tied head is stored once."""
    src, out = dict(sd), {}
    for k in model_keys(cfg):
        if k == "lm_head.weight":
            continue
        m = _EXPERT.match(k)
        if m is None:
            out[names.outside(cfg, k)] = take(src, k, source)
            continue
        stacked = take(src, k, source)  # [E, ...]
        for e in range(stacked.shape[0]):
            out[names.expert(m.group(1), e, m.group(2))] = stacked[e].clone()  # its own storage, as HF saves it
    return head_to_hf(src, out, cfg, source)


def _stacked(src: StateDict, layer: str, proj: str, cfg: ModelConfig, names: ExpertNames, source: str):
    """One stacked expert weight [E, ...] of `layer` from either HF layout."""
    fused = f"{layer}mlp.experts.gate_up_proj"
    if proj in ("gate_proj", "up_proj") and fused in src:
        gate_up = src[fused]  # [E, 2I, H]: popped once both halves are taken
        half = gate_up.shape[1] // 2
        if proj == "up_proj":
            src.pop(fused)
        return gate_up[:, :half] if proj == "gate_proj" else gate_up[:, half:]
    if f"{layer}mlp.experts.{proj}" in src:  # fitlm's stacked layout (a GGUF file's, read back); fused down_proj
        return src.pop(f"{layer}mlp.experts.{proj}")
    assert cfg.num_experts  # (an MoE family's config)
    return torch.stack([take(src, names.expert(layer, e, proj), source) for e in range(cfg.num_experts)])


def experts_from_hf(sd: StateDict, cfg: ModelConfig, names: ExpertNames, source: str) -> StateDict:
    """HF weights (per-expert or fused experts; Mixtral's `block_sparse_moe` or transformers 5's `mlp`) ->
    a complete fitlm state dict."""
    src = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    out: StateDict = {}
    for k in model_keys(cfg):
        if k == "lm_head.weight":
            continue
        m = _EXPERT.match(k)
        if m is not None:
            out[k] = _stacked(src, m.group(1), m.group(2), cfg, names, source)
        else:
            hf = names.outside(cfg, k)
            out[k] = take(src, hf if hf in src or k not in src else k, source)
    return head_from_hf(src, out, cfg, source)
