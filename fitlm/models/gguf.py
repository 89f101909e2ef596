"""GGUF files (llama.cpp's format) <-> fitlm, for every family with GGUF names: config from the metadata, weights
dequantized to fp32 by the `gguf` package. The tokenizer is converted by fitlm.data.gguf_tokenizer.

GGUF is data only (no pickle, no code). Tensor types are whatever `gguf.quants.dequantize` handles in
the installed version (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...); a quantized model is
imported at its quantized precision, it does not get its original weights back.
llama.cpp's converter permutes the rows of q/k for its RoPE layout; that permutation is undone here.
Weights are read one tensor at a time (`GGUFTensors`, `stream_gguf`): a load or an export never needs
more than the tensor at hand on top of what it keeps.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from fitlm import registry
from fitlm.config import ModelConfig, RopeScalingConfig
from fitlm.models.hf import HFFormatError, StateDict
from fitlm.models.rope import frequency_factors, longrope_attention_factor, scaling_from_factors, yarn_factor


class GGUFError(HFFormatError):
    """A GGUF file fitlm cannot import; the message names the file and what is unsupported."""


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - gguf is a declared dependency
        raise GGUFError("reading GGUF needs the `gguf` package: pip install gguf") from None
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise GGUFError(
            f"{path}: not a readable GGUF file ({e}); it may be truncated: download or convert it again"
        ) from None


def _meta(reader) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except Exception:  # noqa: BLE001 - an exotic field type we do not need
            continue
        out[name] = value
    return out


def _family(meta: dict[str, Any], source: str):
    arch = meta.get("general.architecture")
    family = registry.family_for_gguf(arch, experts=bool(meta.get(f"{arch}.expert_count")))
    if family is None:
        known = sorted(f.gguf.arch for f in registry.families() if f.gguf is not None)
        raise GGUFError(
            f"{source}: general.architecture {arch!r} is not supported; fitlm imports GGUF files of "
            f"the llama.cpp architectures {', '.join(known)}. Convert other models from their HF directory"
        )
    return family


def _value(v: Any) -> Any:
    """GGUF stores reals as float32: give back the shortest decimal that rounds to it (1e-06, not 9.99e-07)."""
    return float(str(np.float32(v))) if isinstance(v, (float, np.floating)) else v


def config_from_gguf(meta: dict[str, Any], vocab_rows: int, source: str) -> ModelConfig:
    family = _family(meta, source)
    arch = family.gguf.arch
    k = lambda key, default=None: _value(meta.get(f"{arch}.{key}", default))  # noqa: E731
    heads = int(k("attention.head_count"))
    kv = int(k("attention.head_count_kv", heads))
    hidden = int(k("embedding_length"))
    head_dim = k("attention.key_length")
    scaling = None
    kind = k("rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = RopeScalingConfig(
            type=kind,
            factor=float(k("rope.scaling.factor")),
            original_max_seq_len=k("rope.scaling.original_context_length"),
        )
    elif kind not in (None, "none"):
        raise GGUFError(
            f"{source}: RoPE scaling {kind!r} is not implemented for GGUF import; import the model "
            f"from its Hugging Face directory"
        )
    window = k("attention.sliding_window")
    layers = int(k("block_count"))
    fields = dict(
        arch=family.spec.name,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=None if kv == heads else kv,
        head_dim=int(head_dim) if head_dim and int(head_dim) != hidden // heads else None,
        intermediate_size=int(k("feed_forward_length")),
        vocab_size=vocab_rows,
        max_seq_len=int(k("context_length", 2048)),
        rope_theta=float(k("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        sliding_window=int(window) if window else None,
        norm_eps=float(k("attention.layer_norm_rms_epsilon", 1e-5)),
    )
    fields.update(family.gguf.read_extra(k))
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise GGUFError(f"{source}: its metadata does not make a valid model ({e})") from None


def gguf_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """The "<arch>.<key>" metadata `fitlm export --format gguf` writes for this model (inverse of config_from_gguf)."""
    names = cfg.family.gguf
    out: dict[str, Any] = {
        "context_length": cfg.max_seq_len,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_layers,
        "feed_forward_length": cfg.ffn_size,
        "attention.head_count": cfg.num_heads,
        "attention.head_count_kv": cfg.kv_heads,
        "attention.key_length": cfg.head_size,
        "attention.value_length": cfg.head_size,
        "rope.dimension_count": cfg.head_size,
        "rope.freq_base": float(cfg.rope_theta),
        "attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        "vocab_size": cfg.vocab_size,
    }
    sc = cfg.rope_scaling
    if sc is not None and sc.type == "longrope":  # the factors are tensors (gguf_tensors); these keys go beside
        out["rope.scaling.attn_factor"] = float(longrope_attention_factor(sc, cfg.max_seq_len))
        out["rope.scaling.original_context_length"] = sc.original_max_seq_len or cfg.max_seq_len
    elif sc is not None and sc.type != "llama3":
        if sc.type not in ("linear", "yarn"):
            raise GGUFError(
                f"GGUF export: RoPE scaling {sc.type!r} has no llama.cpp metadata key; export with --format hf"
            )
        out["rope.scaling.type"] = sc.type
        # (linear needs a factor -- validated; yarn's may be null, meaning max_seq_len / original)
        out["rope.scaling.factor"] = float(yarn_factor(sc, cfg.max_seq_len))
        if sc.original_max_seq_len:
            out["rope.scaling.original_context_length"] = sc.original_max_seq_len
    if cfg.sliding_window is not None:
        out["attention.sliding_window"] = cfg.sliding_window
    out.update(names.write_extra(cfg))
    return {f"{names.arch}.{key}": v for key, v in out.items()}


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Invert llama.cpp's `permute` (convert_hf_to_gguf.py) of q/k rows: [H, D/2, 2, in] -> [H, 2, D/2, in]."""
    out_dim = w.shape[0]
    return w.reshape(heads, out_dim // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's `permute` of q/k rows (HF rotate-half -> interleaved pairs): [H,2,D/2,in] -> [H,D/2,2,in]."""
    out_dim = w.shape[0]
    return w.reshape(heads, 2, out_dim // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """llama.cpp's per-frequency RoPE factors: rope_freqs (Llama 3.x) or rope_factors_short/long (LongRoPE)."""
    sc = cfg.rope_scaling
    if sc is None or sc.type not in ("llama3", "longrope"):
        return {}
    if sc.type == "llama3":
        return {
            "rope_freqs.weight": torch.tensor(frequency_factors(sc, cfg.head_size, cfg.rope_theta, cfg.max_seq_len))
        }
    if sc.short_factor == sc.long_factor and longrope_attention_factor(sc, cfg.max_seq_len) == 1.0:
        return {"rope_freqs.weight": torch.tensor(sc.short_factor)}  # fixed factors (a Llama 3 ramp read back)
    return {
        "rope_factors_short.weight": torch.tensor(sc.short_factor),
        "rope_factors_long.weight": torch.tensor(sc.long_factor),
    }


def _scaling_from_tensors(cfg: ModelConfig, factors: dict[str, np.ndarray], meta: dict[str, Any]) -> ModelConfig:
    """The RoPE scaling that llama.cpp's factor tensors encode (see _rope_tensors)."""
    values = {n: [_value(float(v)) for v in np.ravel(f)] for n, f in factors.items()}  # float32 -> shortest decimal
    if "rope_freqs.weight" in values:
        sc = scaling_from_factors(values["rope_freqs.weight"], cfg.head_size, cfg.rope_theta, cfg.max_seq_len)
    elif "rope_factors_short.weight" in values and "rope_factors_long.weight" in values:
        k = lambda key, default=None: _value(meta.get(f"{cfg.family.gguf.arch}.{key}", default))  # noqa: E731
        sc = RopeScalingConfig(
            type="longrope",
            short_factor=values["rope_factors_short.weight"],
            long_factor=values["rope_factors_long.weight"],
            original_max_seq_len=k("rope.scaling.original_context_length"),
        )
        stored = k("rope.scaling.attn_factor")
        if stored is not None and abs(stored - longrope_attention_factor(sc, cfg.max_seq_len)) > 1e-6:
            sc = sc.model_copy(update={"attention_factor": stored})  # only when it is not the formula's value
    else:
        return cfg
    return cfg.model_copy(update={"rope_scaling": sc})


def _is_norm(gguf_base: str) -> bool:
    return gguf_base.endswith("norm")


def gguf_tensors(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig):
    """(llama.cpp name, fp32 tensor) for HF-named weights, (name, tensor) pairs as they stream: renamed, q/k
    permuted and norms offset as llama.cpp's converter does for this family (the inverse of what `GGUFTensors.read`
    undoes)."""
    names = cfg.family.gguf
    top = {ours: theirs for theirs, ours in names.top.items()}
    layer = {ours: theirs for theirs, ours in names.layer.items()}
    experts = _ExpertStacker(names.experts, cfg.num_experts) if names.experts is not None else None
    for name, t in weights:
        if experts is not None and experts.takes(name):
            yield from experts.add(name, t)
            continue
        base, _, part = name.rpartition(".")
        if base in top:
            g = top[base]
        else:
            pieces = base.split(".", 3)  # model, layers, i, rest
            if len(pieces) < 4 or pieces[3] not in layer:
                raise GGUFError(f"GGUF export: weight {name!r} has no llama.cpp name in the {names.arch} architecture")
            g = f"blk.{pieces[2]}.{layer[pieces[3]]}"
        w = t.detach().float().cpu()
        if names.permute_qk and base.endswith("self_attn.q_proj") and part == "weight":
            w = permute_qk(w, cfg.num_heads)
        elif names.permute_qk and base.endswith("self_attn.k_proj") and part == "weight":
            w = permute_qk(w, cfg.kv_heads)
        if names.norm_offset and _is_norm(g.rpartition(".")[2]):
            w = w + names.norm_offset
        yield f"{g}.{part}", w
    yield from _rope_tensors(cfg).items()


# llama.cpp's stacked expert tensors, by fitlm's stacked projection (fitlm.models.experts.GroupedExperts)
EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


class _ExpertStacker:
    """Collects an MoE layer's per-expert HF tensors as they stream and gives each projection back stacked
    under llama.cpp's name once all E have come."""

    def __init__(self, names, num_experts: int | None):
        self.names, self.e = names, int(num_experts or 0)
        roles = {getattr(names, r): f"{r}_proj" for r in ("gate", "up", "down")}  # HF leaf -> fitlm projection
        leaves = "|".join(roles)
        self.pattern = re.compile(rf"^model\.layers\.(\d+)\.{names.module}\.experts\.(\d+)\.({leaves})\.weight$")
        self.roles = roles
        self.pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}

    def takes(self, name: str) -> bool:
        return self.pattern.match(name) is not None

    def add(self, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        m = self.pattern.match(name)
        assert m is not None  # (takes(name) said so)
        key = (m.group(1), m.group(3))
        got = self.pending.setdefault(key, {})
        got[int(m.group(2))] = t.detach().float().cpu()
        if len(got) == self.e:
            del self.pending[key]
            stacked = torch.stack([got[i] for i in range(self.e)])  # [E, out, in]
            yield f"blk.{key[0]}.{EXPERT_TENSORS[self.roles[key[1]]]}.weight", stacked


def _dequantize(t, source: str, data: np.ndarray | None = None) -> np.ndarray:
    """fp32 values of a gguf ReaderTensor `t`, from `data` (its raw values or blocks, as `t.data` is shaped)
    where given, else from `t.data` (the memory-mapped file)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = t.data if data is None else data
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(data, dtype=np.float32)
    try:
        return dequantize(data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(
            f"{source}: tensor {t.name} has type {t.tensor_type.name}, which the installed gguf package "
            f"cannot dequantize; re-quantize the model to Q8_0/Q4_K/Q6_K or F16"
        ) from None


_ROPE = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a GGUF file (no tensor data is read)."""
    return _meta(_reader(Path(path)))


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: Path) -> ModelConfig:
    """The model config from the metadata and the tensor table (only the small RoPE factor tensors are read)."""
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor; not a llama-style language model")
    vocab_rows = int(tensors["token_embd.weight"].shape[-1])  # GGML order: [in, out]
    cfg = config_from_gguf(meta, vocab_rows, str(path))
    if "output.weight" not in tensors:
        cfg = cfg.model_copy(update={"tie_embeddings": True})
    return _scaling_from_tensors(cfg, {n: _dequantize(t, str(path)) for n, t in tensors.items() if n in _ROPE}, meta)


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model config of a GGUF file from its metadata and tensor table (no weights are read)."""
    path = Path(path)
    reader = _reader(path)
    return _config(_meta(reader), {t.name: t for t in reader.tensors}, path)


# HF weights of one row ([1, H]) that GGUF files written by llama.cpp hold as vectors ([H]): Qwen2-MoE's
# shared-expert gate
ROW_VECTORS = (".shared_expert_gate.weight",)


class GGUFTensors:
    """A GGUF file's weights under Hugging Face names, each read, dequantized to fp32 and put back in HF's
    layout (q/k rows unpermuted, Gemma's stored 1 + w norms undone) on its own, when asked for.

    Why not gguf's `ReaderTensor.data`: it is a view of the memory-mapped file, and every page a read touches
    stays in the process's resident set until the file is closed, so a pass over all tensors ends up holding
    the whole file. Here each tensor's bytes are read with plain file reads into a buffer of its own, which
    is gone once the caller drops the tensor. The header (metadata, tensor table) is parsed once, up front."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        reader = _reader(self.path)
        self.meta = _meta(reader)
        tensors = {t.name: t for t in reader.tensors}
        self.config = _config(self.meta, tensors, self.path)
        # HF name -> the file's tensor; the RoPE factors are part of the config (model.rope_scaling), not weights.
        self.entries = {self._hf_name(name): t for name, t in tensors.items() if name not in _ROPE}

    def _hf_name(self, name: str) -> str:
        names = self.config.family.gguf
        base, _, part = name.rpartition(".")
        pieces = base.split(".")
        if pieces[0] == "blk" and len(pieces) == 3 and pieces[2] in names.layer:
            return f"model.layers.{pieces[1]}.{names.layer[pieces[2]]}.{part}"
        stacked = {v: k for k, v in EXPERT_TENSORS.items()}
        if names.experts is not None and pieces[0] == "blk" and len(pieces) == 3 and pieces[2] in stacked:
            return f"model.layers.{pieces[1]}.mlp.experts.{stacked[pieces[2]]}"  # fitlm's own stacked layout
        if base in names.top:
            return f"{names.top[base]}.{part}"
        raise GGUFError(
            f"{self.path}: tensor {name!r} has no place in a fitlm {self.config.arch}; this GGUF model "
            f"uses parts fitlm does not implement"
        )

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(fp32, HF shape) of `name`, from the tensor table alone (GGML lists dimensions innermost first)."""
        shape = tuple(int(d) for d in reversed(self.entries[name].shape.tolist()))
        if name.endswith(ROW_VECTORS) and len(shape) == 1:
            # llama.cpp's writers (its quantizer included) drop trailing unit dimensions: HF's [1, H] comes back [H]
            shape = (1, *shape)
        return torch.float32, shape

    def read(self, name: str) -> torch.Tensor:
        t = self.entries[name]
        raw = np.empty(t.data.shape, dtype=t.data.dtype)  # the shape and dtype of the view; no page is read
        with open(self.path, "rb") as f:
            f.seek(t.data_offset)
            # numpy's stubs give ndarray `__buffer__` (typeshed's Buffer) only for Python 3.12+; mypy targets 3.11
            if f.readinto(memoryview(raw.reshape(-1).view(np.uint8))) != raw.nbytes:  # type: ignore[arg-type]
                raise GGUFError(
                    f"{self.path}: tensor {t.name} is cut short; the file is truncated, download or convert it again"
                )
        w = torch.from_numpy(np.ascontiguousarray(_dequantize(t, str(self.path), raw), dtype=np.float32))
        del raw
        w = w.reshape(self.spec(name)[1])
        names, cfg, kind = self.config.family.gguf, self.config, t.name.rpartition(".")[0].split(".")[-1]
        if names.permute_qk and t.name.endswith(".weight") and kind in ("attn_q", "attn_k"):
            w = _unpermute(w, cfg.num_heads if kind == "attn_q" else cfg.kv_heads)
        if names.norm_offset and _is_norm(kind):
            w = w - names.norm_offset  # llama.cpp stores Gemma's norm scales as 1 + w
        return w

    def state_dict(self) -> StateDict:
        return {name: self.read(name) for name in self.entries}


Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def stream_gguf(
    path: str | Path | GGUFTensors, wanted: Callable[[str], bool] | None = None
) -> tuple[ModelConfig, Specs, Iterator[tuple[str, torch.Tensor]]]:
    """(the file's config, fitlm name -> (fp32, shape), iterator of (fitlm name, fp32 tensor)) of a GGUF file,
    one tensor read and dequantized at a time, through the family's HF adapter
    (`fitlm.models.streaming.stream_source`, as for safetensors; `wanted` as there)."""
    from fitlm.models.streaming import stream_source

    src = path if isinstance(path, GGUFTensors) else GGUFTensors(path)
    return (src.config, *stream_source({name: src for name in src.entries}, src.config, str(src.path), wanted))
