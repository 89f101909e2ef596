"""Hugging Face interop: config.json <-> ModelConfig, one state-dict adapter per family, safetensors dirs.

Only safetensors are read: pickled weights (`*.bin`, `*.pt`) can run code when loaded, so they are
refused with instructions, and nothing in a model directory is ever imported or executed.
`transformers` is not needed here; it is only a test reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from fitlm.config import ModelConfig

StateDict = dict[str, torch.Tensor]
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # the size Hugging Face shards at
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class HFFormatError(ValueError):
    """A Hugging Face directory or config that fitlm cannot read; the message names the file and the fix."""


# --------------------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face config.json mapping (llama or gpt2) into a ModelConfig.

    Features the fitlm models do not implement (biases on llama, RoPE scaling, other activations)
    are refused rather than silently approximated.
    """
    model_type = hf.get("model_type")
    if model_type in LLAMA_LIKE:
        return _llama_config(hf, source)
    if model_type == "gpt2":
        return _gpt2_config(hf, source)
    if model_type == "qwen2":
        raise HFFormatError(f"{source}: model_type 'qwen2' adds biases to the q/k/v projections, which fitlm's llama "
                            f"family does not implement yet; only bias-free llama variants (llama, mistral, "
                            f"SmolLM) and gpt2 can be imported")
    raise HFFormatError(f"{source}: model_type {model_type!r} is not supported; fitlm reads "
                        f"{', '.join(repr(t) for t in (*LLAMA_LIKE, 'gpt2'))} Hugging Face models")


def _refuse(problems: list[str], source: str) -> None:
    if problems:
        raise HFFormatError(f"{source}: this model uses features fitlm does not implement: " + "; ".join(problems))


def _rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)


# Same tensors and maths as Llama: Mistral differs only by sliding-window attention (see _llama_config).
LLAMA_LIKE = ("llama", "mistral")


def _llama_config(hf: Mapping[str, Any], source: str) -> ModelConfig:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    max_len = int(hf.get("max_position_embeddings", 2048))
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window:
        # Within the window, sliding-window attention is plain causal attention: cap the sequence length there.
        max_len = min(max_len, int(window))
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias=true (llama here has no biases)")
    if hf.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads={hidden // heads}")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if hf.get("rope_scaling") or rope_type != "default":
        problems.append(f"RoPE scaling ({hf.get('rope_scaling') or rope_type!r}); only plain RoPE is implemented")
    _refuse(problems, source)
    kv = hf.get("num_key_value_heads")
    return _normalized(ModelConfig(
        arch="llama", hidden_size=hidden, num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=None if kv in (None, heads) else int(kv), intermediate_size=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]), max_seq_len=max_len,
        rope_theta=_rope_theta(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), init_std=float(hf.get("initializer_range", 0.02))))


def _gpt2_config(hf: Mapping[str, Any], source: str) -> ModelConfig:
    problems = []
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={act!r} (only the tanh GELU: 'gelu_new')")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        problems.append("non-standard attention scaling (scale_attn_weights / scale_attn_by_inverse_layer_idx)")
    if hf.get("add_cross_attention"):
        problems.append("cross-attention")
    _refuse(problems, source)
    return _normalized(ModelConfig(
        arch="gpt2", hidden_size=int(hf["n_embd"]), num_layers=int(hf["n_layer"]), num_heads=int(hf["n_head"]),
        intermediate_size=hf.get("n_inner"), vocab_size=int(hf["vocab_size"]),
        max_seq_len=int(hf.get("n_positions") or hf.get("n_ctx") or 1024),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), init_std=float(hf.get("initializer_range", 0.02))))


def _normalized(cfg: ModelConfig) -> ModelConfig:
    """Spell family defaults as null, as a hand-written config would, so configs compare equal."""
    default = cfg.model_copy(update={"intermediate_size": None})
    return default if cfg.intermediate_size == default.ffn_size else cfg


def config_to_hf(cfg: ModelConfig, dtype: str = "float32", bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json Hugging Face transformers needs to rebuild this model."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.init_std, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
              # transformers 5 reads `dtype`, 4.x reads `torch_dtype`.
              "dtype": dtype, "torch_dtype": dtype, "use_cache": True}
    if cfg.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
                "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
                # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta.
                "rope_theta": cfg.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, **common}
    if cfg.arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
                "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len, "n_inner": cfg.intermediate_size,
                "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
                # fitlm trains without dropout; zero keeps HF fine-tuning of the export equivalent.
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, **common}
    raise HFFormatError(f"model.arch={cfg.arch!r} has no Hugging Face export; supported: llama, gpt2")


# --------------------------------------------------------------------------- state-dict adapters


def _take(src: StateDict, key: str, source: str) -> torch.Tensor:
    if key not in src:
        raise HFFormatError(f"{source}: weight {key!r} is missing; the weights do not match the config "
                            f"(num_layers, tie_embeddings) or are not a complete checkpoint")
    return src.pop(key)


def _no_leftovers(src: StateDict, source: str) -> None:
    if src:
        keys = sorted(src)
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        raise HFFormatError(f"{source}: unexpected weights {keys[:5]}{more}; merge adapters (LoRA) first or check "
                            f"that the config matches the weights")


_LLAMA_LAYER = [*(f"self_attn.{n}_proj.weight" for n in "qkvo"),
                *(f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
                "input_layernorm.weight", "post_attention_layernorm.weight"]


def _llama_body_keys(cfg: ModelConfig) -> list[str]:
    """Every llama weight name except lm_head (the names are the same on both sides)."""
    layers = [f"model.layers.{i}.{n}" for i in range(cfg.num_layers) for n in _LLAMA_LAYER]
    return ["model.embed_tokens.weight", *layers, "model.norm.weight"]


def _llama_to_hf(sd: StateDict, cfg: ModelConfig, source: str = "state dict") -> StateDict:
    src = dict(sd)
    out = {k: _take(src, k, source) for k in _llama_body_keys(cfg)}
    head = src.pop("lm_head.weight", None)
    if not cfg.tie_embeddings:  # HF stores a tied head once, under the embedding
        out["lm_head.weight"] = head if head is not None else _take(src, "lm_head.weight", source)
    _no_leftovers(src, source)
    return out


def _llama_from_hf(sd: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    # Old checkpoints saved the RoPE frequencies; they are derived from the config here.
    src = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    out = {k: _take(src, k, source) for k in _llama_body_keys(cfg)}
    head = src.pop("lm_head.weight", None)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # same tensor under both names
    elif head is None:
        raise HFFormatError(f"{source}: 'lm_head.weight' is missing but tie_word_embeddings is false; "
                            f"set tie_word_embeddings: true in config.json if the head is tied")
    else:
        out["lm_head.weight"] = head
    _no_leftovers(src, source)
    return out


# fitlm per-layer name -> (HF name, is a Conv1D weight that needs transposing)
_GPT2_LAYER = {
    "input_layernorm.weight": ("ln_1.weight", False), "input_layernorm.bias": ("ln_1.bias", False),
    "self_attn.o_proj.weight": ("attn.c_proj.weight", True), "self_attn.o_proj.bias": ("attn.c_proj.bias", False),
    "post_attention_layernorm.weight": ("ln_2.weight", False), "post_attention_layernorm.bias": ("ln_2.bias", False),
    "mlp.up_proj.weight": ("mlp.c_fc.weight", True), "mlp.up_proj.bias": ("mlp.c_fc.bias", False),
    "mlp.down_proj.weight": ("mlp.c_proj.weight", True), "mlp.down_proj.bias": ("mlp.c_proj.bias", False),
}
_GPT2_TOP = {"model.embed_tokens.weight": "transformer.wte.weight",
             "model.embed_positions.weight": "transformer.wpe.weight",
             "model.norm.weight": "transformer.ln_f.weight", "model.norm.bias": "transformer.ln_f.bias"}
_GPT2_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")


def _gpt2_to_hf(sd: StateDict, cfg: ModelConfig, source: str = "state dict") -> StateDict:
    src, out = dict(sd), {}
    for ours, theirs in _GPT2_TOP.items():
        out[theirs] = _take(src, ours, source)
    for i in range(cfg.num_layers):
        p, h = f"model.layers.{i}.", f"transformer.h.{i}."
        for part in ("weight", "bias"):
            qkv = [_take(src, f"{p}self_attn.{n}_proj.{part}", source) for n in "qkv"]
            fused = torch.cat(qkv, dim=0)  # [3C,C] weight or [3C] bias
            out[f"{h}attn.c_attn.{part}"] = fused.t() if part == "weight" else fused  # Conv1D is [in, out]
        for ours, (theirs, transpose) in _GPT2_LAYER.items():
            t = _take(src, p + ours, source)
            out[h + theirs] = t.t() if transpose else t
    head = src.pop("lm_head.weight", None)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = head if head is not None else _take(src, "lm_head.weight", source)
    _no_leftovers(src, source)
    return out


def _gpt2_from_hf(sd: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    src: StateDict = {}
    for k, v in sd.items():
        if _GPT2_BUFFER.search(k):
            continue  # causal-mask buffers some old checkpoints carry
        # The original OpenAI conversions lack the "transformer." prefix.
        src[k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k] = v
    out = {ours: _take(src, theirs, source) for ours, theirs in _GPT2_TOP.items()}
    for i in range(cfg.num_layers):
        p, h = f"model.layers.{i}.", f"transformer.h.{i}."
        w = _take(src, f"{h}attn.c_attn.weight", source).t()  # [3C,C]
        b = _take(src, f"{h}attn.c_attn.bias", source)  # [3C]
        for name, wi, bi in zip("qkv", w.chunk(3, dim=0), b.chunk(3, dim=0)):
            out[f"{p}self_attn.{name}_proj.weight"], out[f"{p}self_attn.{name}_proj.bias"] = wi, bi
        for ours, (theirs, transpose) in _GPT2_LAYER.items():
            t = _take(src, h + theirs, source)
            out[p + ours] = t.t() if transpose else t
    head = src.pop("lm_head.weight", None)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        if head is None:
            raise HFFormatError(f"{source}: 'lm_head.weight' is missing but tie_word_embeddings is false; "
                                f"set tie_word_embeddings: true in config.json if the head is tied")
        out["lm_head.weight"] = head
    _no_leftovers(src, source)
    return out


_TO_HF: dict[str, Callable[..., StateDict]] = {"llama": _llama_to_hf, "gpt2": _gpt2_to_hf}
_FROM_HF: dict[str, Callable[..., StateDict]] = {"llama": _llama_from_hf, "gpt2": _gpt2_from_hf}


_WRAPPER_PARTS = re.compile(r"(?<![^.])(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def _model_cfg(cfg: Any) -> ModelConfig:
    return cfg.model if hasattr(cfg, "model") and isinstance(cfg.model, ModelConfig) else cfg


def to_hf_state_dict(model_or_sd: nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """fitlm weights (a model or its state_dict) -> Hugging Face names and layouts (tied head dropped)."""
    cfg = _model_cfg(cfg)
    sd = dict(model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd)
    # Wrappers applied from outside (torch.compile, checkpoint_wrapper) insert a level into the names.
    sd = {_WRAPPER_PARTS.sub("", k): v for k, v in sd.items()}
    if cfg.arch not in _TO_HF:
        raise HFFormatError(f"model.arch={cfg.arch!r} has no Hugging Face adapter; supported: {', '.join(_TO_HF)}")
    return _TO_HF[cfg.arch](sd, cfg)


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str = "state dict") -> StateDict:
    """Hugging Face weights -> a complete fitlm state_dict (a tied head appears under both names)."""
    cfg = _model_cfg(cfg)
    if cfg.arch not in _FROM_HF:
        raise HFFormatError(f"model.arch={cfg.arch!r} has no Hugging Face adapter; supported: {', '.join(_FROM_HF)}")
    return _FROM_HF[cfg.arch](dict(sd), cfg, source)


# --------------------------------------------------------------------------- safetensors directories


def read_safetensors_dir(path: str | Path, device: str | torch.device = "cpu") -> StateDict:
    """All tensors of `model.safetensors` or of the shards named by `model.safetensors.index.json`."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single), device=str(device))
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise HFFormatError(f"{index}: not a valid safetensors index ({e}); re-save the model") from None
        sd: StateDict = {}
        for name in sorted(set(weight_map.values())):
            # Shard names come from the directory's own file: never let them point outside it.
            if Path(name).name != name:
                raise HFFormatError(f"{index}: shard name {name!r} is not a plain file name; refusing to read it")
            shard = path / name
            if not shard.is_file():
                raise HFFormatError(f"{index} names shard {name}, which is missing; download it again")
            sd.update(load_file(str(shard), device=str(device)))
        return sd
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES) if path.is_dir() else []
    if pickles:
        raise HFFormatError(
            f"{path} holds pickled weights ({', '.join(pickles)}) but no model.safetensors: fitlm reads safetensors "
            f"only, because loading a pickle can run arbitrary code. Convert it once in a trusted environment, e.g. "
            f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) (transformers writes safetensors), "
            f"and pass OUT")
    raise HFFormatError(f"{path}: no model.safetensors or model.safetensors.index.json found; "
                        f"pass a directory holding the weights in safetensors format")


def read_hf_config(path: str | Path) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise HFFormatError(f"{cfg_file} does not exist; a Hugging Face model directory needs config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise HFFormatError(f"{cfg_file}: not valid JSON ({e})") from None
    try:
        return config_from_hf(raw, str(cfg_file))
    except KeyError as e:
        raise HFFormatError(f"{cfg_file}: required key {e} is missing") from None


def model_from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str,
                             device: str | torch.device = "cpu",
                             dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """Build the registered model for `cfg` directly from HF-named weights, without a random init pass."""
    from fitlm.registry import build_model

    sd = from_hf_state_dict(hf_sd, cfg, source)
    sd = {k: v.to(device=device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
          for k, v in sd.items()}
    with torch.device("meta"):
        model = build_model(cfg)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise HFFormatError(f"{source}: the weights do not fit the config: {e}") from None
    model.tie_weights()  # assign=True gave the head its own Parameter object; share it again
    model.init_buffers(device)
    return model.eval()


def load_hf_dir(path: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = torch.float32) -> tuple[nn.Module, ModelConfig]:
    """Load a Hugging Face llama/gpt2 directory (config.json + safetensors). dtype=None keeps the stored one."""
    path = Path(path)
    if not path.is_dir():
        raise HFFormatError(f"{path} is not a directory; pass a Hugging Face model directory")
    cfg = read_hf_config(path)
    sd = read_safetensors_dir(path)
    return model_from_hf_state_dict(sd, cfg, str(path), device, dtype), cfg


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # a DTensor: gather the shards
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def write_safetensors(sd: Mapping[str, torch.Tensor], out_dir: str | Path,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write HF-named tensors as model.safetensors, or as shards plus an index when they exceed the limit."""
    out_dir = Path(out_dir)
    # Stale weights from an earlier save (single file vs shards) would shadow or mix with the new ones.
    for old in [*out_dir.glob("model-*-of-*.safetensors"), out_dir / "model.safetensors",
                out_dir / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    tensors = {k: _plain_tensor(v) for k, v in sd.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        files = [out_dir / "model.safetensors"]
        save_file(shards[0], str(files[0]), metadata=meta)
        return files
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        f = out_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(f), metadata=meta)
        files.append(f)
        weight_map.update({k: f.name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def _dtype_name(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


def save_hf_dir(model: nn.Module, cfg: ModelConfig, out_dir: str | Path, bos_token_id: int | None = None,
                eos_token_id: int | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write config.json, generation_config.json and safetensors weights that transformers loads as-is."""
    cfg = _model_cfg(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(to_hf_state_dict(model, cfg), out_dir, max_shard_bytes)
    hf_cfg = config_to_hf(cfg, _dtype_name(model), bos_token_id, eos_token_id)
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    gen = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir


__all__ = ["HFFormatError", "config_from_hf", "config_to_hf", "to_hf_state_dict", "from_hf_state_dict",
           "read_safetensors_dir", "read_hf_config", "model_from_hf_state_dict", "load_hf_dir",
           "write_safetensors", "save_hf_dir"]
