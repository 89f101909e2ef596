"""Hugging Face interop: config.json <-> ModelConfig, one state-dict adapter per family, safetensors dirs.

Only safetensors are read: pickled weights (`*.bin`, `*.pt`) can run code when loaded, so they are
refused with instructions, and nothing in a model directory is ever imported or executed.
`transformers` is not needed here; it is only a test reference.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, cast

import torch
import torch.nn as nn
from safetensors.torch import load_file

from fitlm import registry
from fitlm.config import ModelConfig, RopeScalingConfig
from fitlm.models.safetensors_io import write_safetensors_stream

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM

StateDict = dict[str, torch.Tensor]
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # the size Hugging Face shards at
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class HFFormatError(ValueError):
    """A Hugging Face directory or config that fitlm cannot read; the message names the file and the fix."""


# --------------------------------------------------------------------------- config


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face config.json mapping into a ModelConfig, through the family that reads its
    `model_type`. Features a family does not implement are refused, never silently approximated."""
    model_type = hf.get("model_type")
    family = registry.family_for_hf(model_type)
    if family is not None:
        return family.config_from_hf(hf, source)
    if model_type in UNSUPPORTED_MOE:
        routed = [t for s in registry.specs() if s.moe for t in s.hf_model_types]
        raise HFFormatError(
            f"{source}: model_type {model_type!r} is a mixture-of-experts model fitlm does not implement; "
            f"its MoE families read {', '.join(routed)} "
            f"(all it reads: {', '.join(supported_model_types())})"
        )
    raise HFFormatError(
        f"{source}: model_type {model_type!r} is not supported; fitlm reads "
        f"{', '.join(repr(t) for t in supported_model_types())} Hugging Face models"
    )


UNSUPPORTED_MOE = (
    "deepseek_v2",
    "deepseek_v3",
    "phimoe",
    "dbrx",
    "olmoe",
    "granitemoe",
    "jamba",
    "llama4",
    "llama4_text",
)


def supported_model_types() -> list[str]:
    return sorted(t for s in registry.specs() for t in s.hf_model_types)


def refuse(problems: list[str], source: str) -> None:
    if problems:
        raise HFFormatError(f"{source}: this model uses features fitlm does not implement: " + "; ".join(problems))


_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")
_RopeType = Literal["linear", "dynamic", "yarn", "llama3", "longrope"]  # RopeScalingConfig.type
_LayerType = Literal["full", "sliding"]  # ModelConfig.layer_types
# RopeScalingConfig's keys spelled as transformers spells them (type, original length and truncate differ).
_SCALING_KEYS = tuple(
    k for k in RopeScalingConfig.model_fields if k not in ("type", "original_max_seq_len", "truncate")
)


def rope_from_hf(
    hf: Mapping[str, Any], problems: list[str], layer_type: str = "full_attention"
) -> tuple[float, RopeScalingConfig | None]:
    """(theta, scaling) of one attention type, from transformers 5's `rope_parameters` (flat, or per
    layer type as Gemma 3 writes it) or 4.x's `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(layer_type), Mapping):
        params = params[layer_type]
    if isinstance(params, Mapping) and params:
        theta, sc = params.get("rope_theta", hf.get("rope_theta")), params
    else:
        theta, sc = hf.get("rope_theta"), hf.get("rope_scaling") or {}
    theta = float(theta if theta is not None else 10000.0)
    rope_type = sc.get("rope_type") or sc.get("type") or "default"
    partial = sc.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial} (RoPE over part of each head)")
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_TYPES:
        problems.append(f"RoPE type {rope_type!r} (fitlm implements {', '.join(_ROPE_TYPES)})")
        return theta, None
    original = sc.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if rope_type == "dynamic":
        # transformers grows the base past max_position_embeddings: that is the original length here,
        # and model.max_seq_len (the longest sequence fitlm accepts) becomes factor times it.
        original = int(hf.get("max_position_embeddings", 2048))
    if rope_type in ("linear", "dynamic") and sc.get("factor") is None:
        problems.append(f"RoPE type {rope_type!r} without a factor (rope_scaling.factor, e.g. 2.0)")
        return theta, None
    values = {k: sc[k] for k in (*_SCALING_KEYS, "truncate") if sc.get(k) is not None}
    return theta, RopeScalingConfig(type=cast(_RopeType, rope_type), original_max_seq_len=original, **values)


def rope_to_hf(theta: float, sc: RopeScalingConfig | None) -> dict[str, Any]:
    """One attention type's RoPE as transformers 5's rope_parameters entry."""
    out: dict[str, Any] = {"rope_type": "default" if sc is None else sc.type, "rope_theta": theta}
    if sc is not None:
        out.update({k: getattr(sc, k) for k in _SCALING_KEYS if getattr(sc, k) is not None})
        if sc.original_max_seq_len is not None and sc.type != "dynamic":  # dynamic: max_position_embeddings
            out["original_max_position_embeddings"] = sc.original_max_seq_len
        if sc.type == "yarn":
            out["truncate"] = sc.truncate
    return out


def rope_legacy_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The same RoPE for transformers 4.x readers: rope_theta + rope_scaling."""
    entry = rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
    scaling = {k: v for k, v in entry.items() if k != "rope_theta"} if cfg.rope_scaling is not None else None
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling}


def sliding_from_hf(
    hf: Mapping[str, Any], num_layers: int, default, problems: list[str]
) -> tuple[int | None, list[_LayerType] | None]:
    """(sliding_window, layer_types) from `layer_types` (transformers 5) or the family's rule for older
    configs (`default(i)` -> "full" | "sliding"); (None, None) when no layer slides."""
    window = hf.get("sliding_window")
    given = hf.get("layer_types")
    types: list[_LayerType]
    if given:
        unknown = sorted(set(given) - {"full_attention", "sliding_attention"})
        if unknown:
            problems.append(f"layer_types {unknown} (only full_attention and sliding_attention)")
        types = ["sliding" if t == "sliding_attention" else "full" for t in given]
    else:
        types = [default(i) for i in range(num_layers)]
    if not window or all(t == "full" for t in types):
        return None, None
    return int(window), types


def layer_types_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    types = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    return {"sliding_window": cfg.sliding_window, "layer_types": [f"{t}_attention" for t in types]}


def normalized(cfg: ModelConfig) -> ModelConfig:
    """Spell family defaults as null, as a hand-written config would, so configs compare equal."""
    update: dict[str, Any] = {}
    if cfg.intermediate_size == cfg.model_copy(update={"intermediate_size": None}).ffn_size:
        update["intermediate_size"] = None
    if cfg.head_dim == cfg.hidden_size // cfg.num_heads and cfg.hidden_size % cfg.num_heads == 0:
        update["head_dim"] = None
    if (
        cfg.layer_types is not None
        and cfg.sliding_window is not None
        and cfg.layer_types == [cfg.spec.default_layer_type(i) for i in range(cfg.num_layers)]
    ):
        update["layer_types"] = None
    return cfg.model_copy(update=update) if update else cfg


def config_to_hf(
    cfg: ModelConfig,
    dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> dict[str, Any]:
    """The config.json Hugging Face transformers needs to rebuild this model."""
    family = cfg.family
    if family.config_to_hf is None:
        raise HFFormatError(f"model.arch={cfg.arch!r} has no Hugging Face export")
    common = {
        "architectures": [family.hf_architecture],
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        # Families default pad to an id of their own vocabulary (Phi-3: 32000), which may not exist here.
        "pad_token_id": None,
        # transformers 5 reads `dtype`, 4.x reads `torch_dtype`.
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    return {**common, **family.config_to_hf(cfg)}


def _hf_max_positions(cfg: ModelConfig) -> int:
    sc = cfg.rope_scaling
    return (
        sc.original_max_seq_len
        if sc is not None and sc.type == "dynamic" and sc.original_max_seq_len
        else cfg.max_seq_len
    )


def rope_family_config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """The config.json keys every RoPE decoder shares (Llama, Qwen, Gemma, Phi-3 add their own)."""
    return {
        "model_type": model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "max_position_embeddings": _hf_max_positions(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "attention_dropout": 0.0,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta/rope_scaling.
        "rope_parameters": rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
        **rope_legacy_hf(cfg),
        **layer_types_to_hf(cfg),
    }


def rope_family_config(
    hf: Mapping[str, Any], arch: str, problems: list[str], default_layer_type, **extra: Any
) -> ModelConfig:
    """The ModelConfig fields every RoPE decoder reads the same way; `extra` are the family's own."""
    hidden, heads, layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    kv = hf.get("num_key_value_heads")
    theta, scaling = rope_from_hf(hf, problems)
    window, types = sliding_from_hf(hf, layers, default_layer_type, problems)
    max_len = int(hf.get("max_position_embeddings", 2048))
    if scaling is not None and scaling.type == "dynamic":
        assert scaling.factor is not None  # (rope_from_hf refuses a dynamic scaling without one)
        max_len = int(max_len * scaling.factor)
    return ModelConfig(
        arch=arch,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=None if kv in (None, heads) else int(kv),
        head_dim=hf.get("head_dim"),
        intermediate_size=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        max_seq_len=max_len,
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        layer_types=types,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **extra,
    )


# --------------------------------------------------------------------------- state-dict adapters


def take(src: StateDict, key: str, source: str) -> torch.Tensor:
    if key not in src:
        raise HFFormatError(
            f"{source}: weight {key!r} is missing; the weights do not match the config "
            f"(num_layers, tie_embeddings) or are not a complete checkpoint"
        )
    return src.pop(key)


def no_leftovers(src: StateDict, source: str) -> None:
    if src:
        keys = sorted(src)
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        raise HFFormatError(
            f"{source}: unexpected weights {keys[:5]}{more}; merge adapters (LoRA) first or check "
            f"that the config matches the weights"
        )


def model_keys(cfg: ModelConfig) -> list[str]:
    """Every weight name of the family's module for `cfg` (built on the meta device: no memory, no init)."""
    return list(_model_keys(cfg.model_dump_json()))


@functools.lru_cache(maxsize=16)
def _model_keys(cfg_json: str) -> tuple[str, ...]:
    # Cached: a streamed load converts one tensor at a time, each through the family's whole adapter.
    with torch.device("meta"):
        model = registry.build_model(ModelConfig.model_validate_json(cfg_json))
    return tuple(model.state_dict())


def head_to_hf(src: StateDict, out: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    """Move the output head from `src` into the HF-named `out` (a tied head is stored once, under the
    embedding); then nothing may be left in `src`."""
    head = src.pop("lm_head.weight", None)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = head if head is not None else take(src, "lm_head.weight", source)
    no_leftovers(src, source)
    return out


def head_from_hf(src: StateDict, out: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    """Move the output head from the HF-named `src` into `out` (a tied head is the embedding tensor under
    both names); then nothing may be left in `src`."""
    head = src.pop("lm_head.weight", None)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # same tensor under both names
    elif head is None:
        raise HFFormatError(
            f"{source}: 'lm_head.weight' is missing but tie_word_embeddings is false; "
            f"set tie_word_embeddings: true in config.json if the head is tied"
        )
    else:
        out["lm_head.weight"] = head
    no_leftovers(src, source)
    return out


def same_names_to_hf(sd: StateDict, cfg: ModelConfig, source: str = "state dict") -> StateDict:
    """For families whose module names are HF's: check completeness, store a tied head once."""
    src = dict(sd)
    return head_to_hf(src, {k: take(src, k, source) for k in model_keys(cfg) if k != "lm_head.weight"}, cfg, source)


def same_names_from_hf(sd: StateDict, cfg: ModelConfig, source: str) -> StateDict:
    # Old checkpoints saved the RoPE frequencies; they are derived from the config here.
    src = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    return head_from_hf(src, {k: take(src, k, source) for k in model_keys(cfg) if k != "lm_head.weight"}, cfg, source)


_WRAPPER_PARTS = re.compile(r"(?<![^.])(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def strip_wrappers(name: str) -> str:
    """A parameter's name in the unwrapped model: without the levels torch.compile, checkpoint_wrapper or
    FSDP1 insert."""
    return _WRAPPER_PARTS.sub("", name)


def _model_cfg(cfg: Any) -> ModelConfig:
    return cfg.model if hasattr(cfg, "model") and isinstance(cfg.model, ModelConfig) else cfg


def to_hf_state_dict(model_or_sd: nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """fitlm weights (a model or its state_dict) -> Hugging Face names and layouts (tied head dropped)."""
    cfg = _model_cfg(cfg)
    sd = dict(model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd)
    # Wrappers applied from outside (torch.compile, checkpoint_wrapper) insert a level into the names.
    sd = {strip_wrappers(k): v for k, v in sd.items()}
    return cfg.family.to_hf(sd, cfg)


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str = "state dict") -> StateDict:
    """Hugging Face weights -> a complete fitlm state_dict (a tied head appears under both names)."""
    cfg = _model_cfg(cfg)
    return cfg.family.from_hf(dict(sd), cfg, source)


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
            f"and pass OUT"
        )
    raise HFFormatError(
        f"{path}: no model.safetensors or model.safetensors.index.json found; "
        f"pass a directory holding the weights in safetensors format"
    )


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


def model_from_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    source: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
) -> nn.Module:
    """Build the registered model for `cfg` directly from HF-named weights, without a random init pass."""
    sd = from_hf_state_dict(hf_sd, cfg, source)
    sd = {
        k: v.to(device=device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
        for k, v in sd.items()
    }
    with torch.device("meta"):
        model = cast("CausalLM", registry.build_model(cfg))  # (a registered family's model)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise HFFormatError(f"{source}: the weights do not fit the config: {e}") from None
    model.tie_weights()  # assign=True gave the head its own Parameter object; share it again
    model.init_buffers(device)
    return model.eval()


def load_hf_dir(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32
) -> tuple[nn.Module, ModelConfig]:
    """Load a Hugging Face directory of a registered family (config.json + safetensors). dtype=None keeps the stored
    one."""
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


def write_safetensors(
    sd: Mapping[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[Path]:
    """Write HF-named tensors as model.safetensors, or as shards plus an index when they exceed the limit."""
    clear_weights(out_dir)
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}
    return write_safetensors_stream(specs, ((k, _plain_tensor(v)) for k, v in sd.items()), out_dir, max_shard_bytes)


def clear_weights(out_dir: str | Path) -> None:
    """Remove the weights of an earlier save (single file vs shards would shadow or mix with new ones)."""
    out_dir = Path(out_dir)
    for old in [
        *out_dir.glob("model-*-of-*.safetensors"),
        out_dir / "model.safetensors",
        out_dir / "model.safetensors.index.json",
    ]:
        old.unlink(missing_ok=True)


def _dtype_name(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


def save_hf_dir(
    model: nn.Module,
    cfg: ModelConfig,
    out_dir: str | Path,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write config.json, generation_config.json and safetensors weights that transformers loads as-is."""
    cfg = _model_cfg(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(to_hf_state_dict(model, cfg), out_dir, max_shard_bytes)
    write_hf_configs(out_dir, cfg, _dtype_name(model), bos_token_id, eos_token_id)
    return out_dir


def write_hf_configs(
    out_dir: Path, cfg: ModelConfig, dtype: str, bos: int | None, eos: int | None, **generation
) -> None:
    """config.json and generation_config.json beside HF weights stored in `dtype` ("float32", ...);
    `generation`: generation_config keys to add or override (pad_token_id, a list of eos_token_id, ...)."""
    hf_cfg = config_to_hf(cfg, dtype, bos, eos)
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False, **generation}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


__all__ = [
    "HFFormatError",
    "config_from_hf",
    "config_to_hf",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "read_safetensors_dir",
    "read_hf_config",
    "model_from_hf_state_dict",
    "load_hf_dir",
    "write_safetensors",
    "save_hf_dir",
    "write_hf_configs",
]
