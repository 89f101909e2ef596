"""GPT-2 config.json and weights <-> fitlm: HF fuses q/k/v into `attn.c_attn` and stores linears as
Conv1D ([in, out]); fitlm's GPT-2 uses the Llama names, so this adapter renames, splits and transposes."""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from fitlm.config import ModelConfig
from fitlm.models.hf import StateDict, head_from_hf, head_to_hf, normalized, refuse, take


def config_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    problems = []
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={act!r} (only the tanh GELU: 'gelu_new')")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        problems.append("non-standard attention scaling (scale_attn_weights / scale_attn_by_inverse_layer_idx)")
    if hf.get("add_cross_attention"):
        problems.append("cross-attention")
    refuse(problems, source)
    return normalized(
        ModelConfig(
            arch="gpt2",
            hidden_size=int(hf["n_embd"]),
            num_layers=int(hf["n_layer"]),
            num_heads=int(hf["n_head"]),
            intermediate_size=hf.get("n_inner"),
            vocab_size=int(hf["vocab_size"]),
            max_seq_len=int(hf.get("n_positions") or hf.get("n_ctx") or 1024),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_inner": cfg.intermediate_size,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
        # fitlm trains without dropout; zero keeps HF fine-tuning of the export equivalent.
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


# fitlm per-layer name -> (HF name, is a Conv1D weight that needs transposing)
_GPT2_LAYER = {
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "self_attn.o_proj.weight": ("attn.c_proj.weight", True),
    "self_attn.o_proj.bias": ("attn.c_proj.bias", False),
    "post_attention_layernorm.weight": ("ln_2.weight", False),
    "post_attention_layernorm.bias": ("ln_2.bias", False),
    "mlp.up_proj.weight": ("mlp.c_fc.weight", True),
    "mlp.up_proj.bias": ("mlp.c_fc.bias", False),
    "mlp.down_proj.weight": ("mlp.c_proj.weight", True),
    "mlp.down_proj.bias": ("mlp.c_proj.bias", False),
}
_GPT2_TOP = {
    "model.embed_tokens.weight": "transformer.wte.weight",
    "model.embed_positions.weight": "transformer.wpe.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "model.norm.bias": "transformer.ln_f.bias",
}
_GPT2_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")


def to_hf(sd: StateDict, cfg: ModelConfig, source: str = "state dict") -> StateDict:
    src, out = dict(sd), {}
    for ours, theirs in _GPT2_TOP.items():
        out[theirs] = take(src, ours, source)
    for i in range(cfg.num_layers):
        p, h = f"model.layers.{i}.", f"transformer.h.{i}."
        for part in ("weight", "bias"):
            qkv = [take(src, f"{p}self_attn.{n}_proj.{part}", source) for n in "qkv"]
            fused = torch.cat(qkv, dim=0)  # [3C,C] weight or [3C] bias
            out[f"{h}attn.c_attn.{part}"] = fused.t() if part == "weight" else fused  # Conv1D is [in, out]
        for ours, (theirs, transpose) in _GPT2_LAYER.items():
            t = take(src, p + ours, source)
            out[h + theirs] = t.t() if transpose else t
    return head_to_hf(src, out, cfg, source)


def from_hf(sd: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    src: StateDict = {}
    for k, v in sd.items():
        if _GPT2_BUFFER.search(k):
            continue  # causal-mask buffers some old checkpoints carry
        # The original OpenAI conversions lack the "transformer." prefix.
        src[k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k] = v
    out = {ours: take(src, theirs, source) for ours, theirs in _GPT2_TOP.items()}
    for i in range(cfg.num_layers):
        p, h = f"model.layers.{i}.", f"transformer.h.{i}."
        w = take(src, f"{h}attn.c_attn.weight", source).t()  # [3C,C]
        b = take(src, f"{h}attn.c_attn.bias", source)  # [3C]
        for name, wi, bi in zip("qkv", w.chunk(3, dim=0), b.chunk(3, dim=0)):
            out[f"{p}self_attn.{name}_proj.weight"], out[f"{p}self_attn.{name}_proj.bias"] = wi, bi
        for ours, (theirs, transpose) in _GPT2_LAYER.items():
            t = take(src, h + theirs, source)
            out[p + ours] = t.t() if transpose else t
    return head_from_hf(src, out, cfg, source)
