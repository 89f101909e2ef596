"""Read a GGUF file (llama.cpp's format) into a fitlm Llama: config from the metadata, weights
dequantized to fp32 by the `gguf` package, and a tokenizer.json when the vocabulary is byte-level BPE.

GGUF is data only (no pickle, no code). Tensor types are whatever `gguf.quants.dequantize` handles in
the installed version (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...); a quantized model is
imported at its quantized precision, it does not get its original weights back.
llama.cpp's converter permutes the rows of q/k for its RoPE layout; that permutation is undone here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fitlm.config import ModelConfig
from fitlm.models.hf import HFFormatError, StateDict


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
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None


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


def config_from_gguf(meta: dict[str, Any], vocab_rows: int, source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{source}: general.architecture {arch!r} is not supported; fitlm imports 'llama' GGUF "
                        f"files (Llama, Mistral, SmolLM-style). Convert other families from their HF directory")
    k = lambda key, default=None: meta.get(f"llama.{key}", default)  # noqa: E731
    heads = int(k("attention.head_count"))
    kv = int(k("attention.head_count_kv", heads))
    if k("rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"{source}: RoPE scaling ({k('rope.scaling.type')}) is not implemented in fitlm")
    return ModelConfig(arch="llama", hidden_size=int(k("embedding_length")), num_layers=int(k("block_count")),
                       num_heads=heads, num_kv_heads=None if kv == heads else kv,
                       intermediate_size=int(k("feed_forward_length")), vocab_size=vocab_rows,
                       max_seq_len=int(k("context_length", 2048)), rope_theta=float(k("rope.freq_base", 10000.0)),
                       norm_eps=float(k("attention.layer_norm_rms_epsilon", 1e-5)))


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Invert llama.cpp's `permute` (convert_hf_to_gguf.py) of q/k rows: [H, D/2, 2, in] -> [H, 2, D/2, in]."""
    out_dim = w.shape[0]
    return w.reshape(heads, out_dim // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _dequantize(t, source: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32)
    try:
        return dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"{source}: tensor {t.name} has type {t.tensor_type.name}, which the installed gguf package "
                        f"cannot dequantize; re-quantize the model to Q8_0/Q4_K/Q6_K or F16") from None


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model config of a GGUF file from its metadata and tensor table (no tensor data is read)."""
    path = Path(path)
    reader = _reader(path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor; not a llama-style language model")
    cfg = config_from_gguf(_meta(reader), int(tensors["token_embd.weight"].shape[-1]), str(path))
    return cfg if "output.weight" in tensors else cfg.model_copy(update={"tie_embeddings": True})


def read_gguf(path: str | Path) -> tuple[ModelConfig, StateDict, dict[str, Any]]:
    """(config, HF-named fp32 state dict, metadata) of a llama GGUF file."""
    path = Path(path)
    reader = _reader(path)
    meta = _meta(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor; not a llama-style language model")
    vocab_rows = int(tensors["token_embd.weight"].shape[-1])  # GGML order: [in, out]
    cfg = config_from_gguf(meta, vocab_rows, str(path))
    if "output.weight" not in tensors:
        cfg = cfg.model_copy(update={"tie_embeddings": True})
    sd: StateDict = {}
    for name, t in tensors.items():
        if name.endswith("rope_freqs.weight"):
            raise GGUFError(f"{path}: has rope_freqs (Llama-3.1-style RoPE scaling), which fitlm does not implement")
        base, _, part = name.rpartition(".")
        pieces = base.split(".")
        if pieces[0] == "blk" and len(pieces) == 3 and pieces[2] in _LAYER:
            ours = f"model.layers.{pieces[1]}.{_LAYER[pieces[2]]}.{part}"
        elif base in _TOP:
            ours = f"{_TOP[base]}.{part}"
        else:
            raise GGUFError(f"{path}: tensor {name!r} has no place in a fitlm llama; this GGUF model uses parts "
                            f"fitlm does not implement")
        w = torch.from_numpy(np.array(_dequantize(t, str(path)), dtype=np.float32))  # a copy: the file is memory-mapped read-only
        if pieces[-1] == "attn_q":
            w = _unpermute(w, cfg.num_heads)
        elif pieces[-1] == "attn_k":
            w = _unpermute(w, cfg.kv_heads)
        sd[ours] = w
    return cfg, sd, meta


def gguf_tokenizer_json(meta: dict[str, Any]) -> str | None:
    """A tokenizer.json for a byte-level BPE vocabulary (tokenizer.ggml.model == "gpt2"), else None.

    Pre-tokenization uses GPT-2's split rule; models whose `tokenizer.ggml.pre` names another rule
    (e.g. llama-bpe's digit grouping) may split some text differently. SentencePiece vocabularies
    ("llama") are not converted: pass their tokenizer.json from the HF repository instead.
    """
    if meta.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.tokens" not in meta:
        return None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    specials = [t for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if i < len(types) and int(types[i]) == 3]
    if specials:
        tok.add_special_tokens(specials)
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False)
