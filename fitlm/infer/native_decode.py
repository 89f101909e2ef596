"""Single-stream decode steps of Llama-architecture models in C (`decode_step.c`): one call a token.

Why: a batch-1 decode step on a CPU is the weights streaming through matrix-vector products plus ~20 small
torch ops a layer, each a few microseconds of dispatch for a few hundred numbers (a quarter of a 135M model's
step on 2 cores). `decode_step.c` runs the whole step (embedding row, every block, final norm, logits) in one
call, rounding where the torch forward rounds (see its header), so greedy tokens stay the torch path's and
transformers'.

Where it applies (`NativeDecoder.for_model`; otherwise None and `generate` keeps the torch step): a
DecoderModel body of pre-norm blocks with RMSNorm, self-attention with RoPE (any scaling: the tables come from
the model's own rotary embedding), optional q/k/v biases, Qwen3's q/k norms, a sliding window; a SwiGLU MLP;
plain `nn.Linear`s (no LoRA wrappers, no quantized or sharded weights) without hooks; fp32, bf16 or fp16 on
the CPU; one sequence. That is Llama, Mistral, Qwen2, Qwen3, Phi-3 and SmolLM; Gemma, GPT-2 and the MoE
families keep the torch step. The prompt's prefill stays torch's (a matrix product, not dispatch-bound); the
cache is the same `KVCache`. `FITLM_NATIVE=0` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Iterator, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.infer import native
from fitlm.infer.file_backed import copy_file_backed
from fitlm.models.decoder import DecoderModel, PreNormBlock
from fitlm.models.layers import GatedMLP, KVCache, RMSNorm, SelfAttention, causal_attention

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM

# Rows a C step takes, by dtype. Beyond, the products are bound by the cores' multiply-adds, not by memory, and
# oneDNN's GEMM is as fast or faster (fp32, 2 cores: 4 rows 20.5 against 24.6 ms a step, 8 rows 29.8 against
# 28.5; 1 thread, 8 rows: 132 against 157 tokens/s). In half precision the AVX-512 BF16 pair products keep the
# C step ahead up to 8 rows (8 bf16 rows: 17.5 against 20.7 ms), and each row rounds on its own there.
MAX_BATCH = {torch.float32: 4, torch.bfloat16: 8, torch.float16: 8}
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # decode_step.c's dtype codes
# decode_step.c's per-layer slots, in its order
SLOTS = "in_norm wq wk wv bq bk bv wo bo post_norm wgate wup wdown kcache vcache qnorm knorm".split()


class _Model(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_int)
            for name in ("dtype", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "max_len")
        ],
        ("window", ctypes.c_int),
        ("nthreads", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layer", ctypes.c_void_p),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("head", ctypes.c_void_p),
    ]


def _plain_linear(m: object, dtype: torch.dtype) -> bool:
    return (
        type(m) is nn.Linear
        and type(m.weight.data) is torch.Tensor  # not a DTensor, NF4 or other subclass
        and all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in m.parameters())
    )


def _plain_norm(m: object, dtype: torch.dtype, eps: float) -> bool:
    return type(m) is RMSNorm and not m.unit_offset and m.eps == eps and _plain_params(m, dtype)


def _plain_params(m: nn.Module, dtype: torch.dtype) -> bool:
    return all(
        type(p.data) is torch.Tensor and p.dtype == dtype and p.device.type == "cpu" and p.is_contiguous()
        for p in m.parameters(recurse=False)
    )


def _no_hooks(module: nn.Module) -> bool:
    global_hooks = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
    return not global_hooks and not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _rows(linear: nn.Linear, parts: list[int]) -> Iterator[tuple[int, int | None]]:
    """(weight pointer, bias pointer or None) of consecutive row blocks of `linear` ([sum of parts, in])."""
    w, b, row = linear.weight, linear.bias, 0
    for n in parts:
        yield (
            w.data_ptr() + row * w.stride(0) * w.element_size(),
            None if b is None else b.data_ptr() + row * b.element_size(),
        )
        row += n


def _attention_ok(attn: object, dtype: torch.dtype, eps: float) -> bool:
    if type(attn) is not SelfAttention or attn.attend is not causal_attention or attn.softcap is not None:
        return False
    names = ("qkv_proj", "o_proj") if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj", "o_proj")
    norms = [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    return all(_plain_linear(getattr(attn, n), dtype) for n in names) and all(_plain_norm(n, dtype, eps) for n in norms)


def _mlp_ok(mlp: object, dtype: torch.dtype) -> bool:
    if type(mlp) is not GatedMLP or mlp.act is not F.silu:
        return False
    names = ("gate_up_proj", "down_proj") if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj", "down_proj")
    return all(_plain_linear(getattr(mlp, n), dtype) and getattr(mlp, n).bias is None for n in names)


def _block_ok(block: object, dtype: torch.dtype, eps: float) -> bool:
    return (
        type(block) is PreNormBlock
        and _plain_norm(block.input_layernorm, dtype, eps)
        and _plain_norm(block.post_attention_layernorm, dtype, eps)
        and _attention_ok(block.self_attn, dtype, eps)
        and _mlp_ok(block.mlp, dtype)
    )


def unsupported(model: nn.Module, cache: KVCache) -> str | None:
    """Why `model` (with `cache`) cannot decode in C, or None when it can (see the module doc)."""
    body: Any = getattr(model, "model", None)  # (checked piece by piece below)
    head: Any = getattr(model, "lm_head", None)
    if type(body) is not DecoderModel or body.embed_tokens is None or body.norm is None:
        return "not a DecoderModel body with its embedding and final norm"
    dtype, eps = body.embed_tokens.weight.dtype, body.norm.eps if isinstance(body.norm, RMSNorm) else None
    if dtype not in DTYPES or eps is None:
        return f"dtype {dtype} or a final norm other than RMSNorm"
    if body.embed_scale is not None or body.rotary_emb_local is not None:
        return "scaled embeddings or a second rotary table (Gemma)"
    cfg = cast("CausalLM", model).config
    if cfg.final_logit_softcap is not None or not _plain_linear(head, dtype) or head.bias is not None:
        return "a soft-capped, biased or wrapped output projection"
    if not (_plain_params(body.embed_tokens, dtype) and _plain_norm(body.norm, dtype, eps)):
        return "a wrapped embedding or final norm"
    blocks: list[Any] = list(body.layers.values())
    if not all(_block_ok(block, dtype, eps) for block in blocks):
        return "a block other than the pre-norm RMSNorm / RoPE attention / SwiGLU block (or a wrapped layer)"
    windows = {block.self_attn.window for block in blocks}
    scales = {block.self_attn.scale for block in blocks}
    if len(windows) > 1 or len(scales) > 1:
        return "layers with different attention windows or scales"
    if not _no_hooks(model):
        return "forward hooks on the model"
    if not 1 <= cache.batch_size <= MAX_BATCH[dtype]:
        return f"a KV cache of more than {MAX_BATCH[dtype]} sequences in {dtype} (compute-bound products: oneDNN's)"
    want = (cache.batch_size, cfg.kv_heads, cache.max_len, cfg.head_size)  # [B,K,max_len,D], what new_kv_cache makes
    kv = (*cache.k, *cache.v)
    if len(cache.k) != len(blocks) or any(
        t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != want for t in kv
    ):
        return f"a KV cache other than the model's own (per layer [B,K,max_len,D] = {list(want)}, {dtype}, CPU)"
    return None


class NativeDecoder:
    """Decode steps of `model` into `cache` through decode_step.c; `for_model` says whether it applies."""

    def __init__(self, model: nn.Module, cache: KVCache, lib: ctypes.CDLL):
        self.lib, self.cache = lib, cache
        lm: Any = model  # (a family's model that `unsupported` accepted)
        body: DecoderModel = lm.model
        self.rotary = body.rotary_emb
        self.dtype = body.embed_tokens.weight.dtype
        self.vocab = lm.lm_head.weight.shape[0]
        layers: list[Any] = list(body.layers.values())
        attn0, cfg = layers[0].self_attn, lm.config
        d = attn0.head_dim
        heads = attn0.o_proj.weight.shape[1] // d
        kv_heads = cache.k[0].shape[1]
        ffn = layers[0].mlp.down_proj.weight.shape[1]
        slots = [self._slots(block, i, cache, heads, kv_heads, d, ffn) for i, block in enumerate(layers)]
        self.pointers = (ctypes.c_void_p * (len(SLOTS) * len(layers)))(*[p for s in slots for p in s])
        self.struct = _Model(
            dtype=DTYPES[self.dtype], layers=len(layers), hidden=cfg.hidden_size, heads=heads, kv_heads=kv_heads,
            head_dim=d, ffn=ffn, vocab=self.vocab, max_len=cache.max_len, window=attn0.window or 0,
            eps=lm.model.norm.eps, scale=attn0.scale if attn0.scale is not None else d**-0.5,
            layer=ctypes.cast(self.pointers, ctypes.c_void_p), embed=body.embed_tokens.weight.data_ptr(),
            final_norm=lm.model.norm.weight.data_ptr(), head=lm.lm_head.weight.data_ptr(),
        )  # fmt: skip
        # The tensors the C struct points into, held so none is freed while it lives; `step` checks that the model
        # and the cache still use them (a weight or cache buffer swapped for another would leave a dangling pointer).
        self.kept = [*(p.data for p in model.parameters()), *cache.k, *cache.v]
        self.anchors = (body.embed_tokens.weight, lm.lm_head.weight)
        self.anchored = self._anchor_pointers()

    def _anchor_pointers(self) -> tuple[int, ...]:
        """Where the embedding, the head and the cache's first and last buffers are now."""
        return (*(p.data_ptr() for p in self.anchors), self.cache.k[0].data_ptr(), self.cache.v[-1].data_ptr())

    @staticmethod
    def _slots(block: Any, i: int, cache: KVCache, heads: int, kv: int, d: int, ffn: int) -> list[int | None]:
        attn, mlp = block.self_attn, block.mlp  # (a PreNormBlock's SelfAttention and GatedMLP)
        if hasattr(attn, "qkv_proj"):
            (wq, bq), (wk, bk), (wv, bv) = _rows(attn.qkv_proj, [heads * d, kv * d, kv * d])
        else:
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            (wq, bq), (wk, bk), (wv, bv) = (next(_rows(m, [m.out_features])) for m in projections)
        if hasattr(mlp, "gate_up_proj"):
            (wgate, _), (wup, _) = _rows(mlp.gate_up_proj, [ffn, ffn])
        else:
            wgate, wup = mlp.gate_proj.weight.data_ptr(), mlp.up_proj.weight.data_ptr()
        o_bias = attn.o_proj.bias
        norm = {n: None if m is None else m.weight.data_ptr() for n, m in (("q", attn.q_norm), ("k", attn.k_norm))}
        return [
            block.input_layernorm.weight.data_ptr(), wq, wk, wv, bq, bk, bv, attn.o_proj.weight.data_ptr(),
            None if o_bias is None else o_bias.data_ptr(), block.post_attention_layernorm.weight.data_ptr(),
            wgate, wup, mlp.down_proj.weight.data_ptr(), cache.k[i].data_ptr(), cache.v[i].data_ptr(),
            norm["q"], norm["k"],
        ]  # fmt: skip

    @classmethod
    def for_model(cls, model: nn.Module, cache: KVCache) -> NativeDecoder | None:
        """The decoder, or None where decode_step.c does not apply or could not be built (the torch step then)."""
        if unsupported(model, cache) is not None:
            return None
        lib = native.library("decode_step")
        if lib is None:
            return None
        if lib.fitlm_decode_step.argtypes is None:  # (once per process: the library is loaded once)
            # (model, batch, tokens, first cells, cell, cos, sin, logits)
            lib.fitlm_decode_step.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            lib.fitlm_decode_step.argtypes += [ctypes.c_int64] + [ctypes.c_void_p] * 3
            lib.fitlm_decode_step.restype = ctypes.c_int
        copy_file_backed(model)  # (weights still in their file's pages stream slower: fitlm.infer.file_backed)
        return cls(model, cache, lib)

    def step(
        self, tokens: list[int], positions: list[int] | None = None, first: list[int] | None = None
    ) -> torch.Tensor:
        """Logits [B,V] (the model's dtype) of tokens[b] fed to cache row b at the cache's next cell, their keys and
        values cached. `positions`: each token's position (default: the cell, as `generate` has it); `first`: each
        row's first cell of its own (default 0; SlotBatch right-aligns shorter rows), the cells it attends from."""
        cell, rows = self.cache.length, self.cache.batch_size
        positions = [cell] * rows if positions is None else positions
        first = [0] * rows if first is None else first
        if not len(tokens) == len(positions) == len(first) == rows:
            raise ValueError(f"a step needs one token, position and first cell per cache row ({rows})")
        if cell >= self.cache.max_len:
            raise ValueError(f"KV cache is full: its {self.cache.max_len} positions are taken; allocate a longer cache")
        if not all(0 <= t < self.vocab for t in tokens):
            raise ValueError(f"token ids {tokens} leave the vocabulary [0, {self.vocab})")
        if not all(0 <= f <= cell for f in first) or not all(p >= 0 for p in positions):
            raise ValueError(f"first cells {first} must lie in [0, {cell}] and positions {positions} be >= 0")
        if self._anchor_pointers() != self.anchored:
            raise RuntimeError("the model's weights or the KV cache were replaced: make a new NativeDecoder")
        cos, sin = self.rotary(torch.tensor(positions)[:, None])  # [B,1,D] each: the model's own table (any scaling)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()  # (a model cast whole has half tables)
        ids, starts = torch.tensor(tokens, dtype=torch.long), torch.tensor(first, dtype=torch.long)  # [B] each
        self.struct.nthreads = torch.get_num_threads()
        logits = torch.empty(rows, self.vocab, dtype=self.dtype)  # [B,V]
        args = (ids.data_ptr(), starts.data_ptr(), cell, cos.data_ptr(), sin.data_ptr(), logits.data_ptr())
        if self.lib.fitlm_decode_step(ctypes.byref(self.struct), rows, *args):
            raise MemoryError("decode_step.c could not allocate its scratch buffers")
        self.cache.advance(1)
        return logits


__all__ = ["NativeDecoder", "unsupported"]
