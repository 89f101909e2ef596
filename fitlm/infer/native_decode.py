"""Decode steps of Llama-architecture models in C (`decode_step.c`): one call a token, for 1 to 16 streams.

Why: a batch-1 decode step on a CPU is the weights streaming through matrix-vector products plus ~20 small
torch ops a layer, each a few microseconds of dispatch for a few hundred numbers (a quarter of a 135M model's
step on 2 cores). `decode_step.c` runs the whole step (embedding row, every block, final norm, logits) in one
call, rounding where the torch forward rounds (see its header), so greedy tokens stay the torch path's and
transformers'.

Where it applies (`NativeDecoder.for_model`; otherwise None and `generate` keeps the torch step): a
DecoderModel body of pre-norm blocks with RMSNorm, self-attention with RoPE (any scaling: the tables come from
the model's own rotary embedding), optional q/k/v biases, Qwen3's q/k norms, a sliding window; a SwiGLU MLP;
plain `nn.Linear`s (no LoRA wrappers, no quantized or sharded weights) without hooks; fp32, bf16 or fp16 on
the CPU; up to MAX_BATCH cache rows. That is Llama, Mistral, Qwen2, Qwen3, Phi-3 and SmolLM; Gemma, GPT-2 and the MoE
families keep the torch step. The prompt's prefill stays torch's (a matrix product, not dispatch-bound); the
cache is the same `KVCache`. `FITLM_NATIVE=0` turns it off.

The products read packed copies of the weights (`pack_panels`: panels of PW output rows, the outputs in the
vector lanes), so one pass over a panel serves 8 rows at the cores' multiply-add rate and a row's sums never
depend on the batch. The copies are cached per weight (`panels_of`) and made again when the weight changes (an
in-place update such as an optimizer step between samplings, new data, a cast); `step` checks before each call.
Cost: one more copy of the linear weights while the model lives; where it would take over half the free host
memory, `for_model` keeps the torch step.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from fitlm.hardware import available_host_memory
from fitlm.infer import native
from fitlm.infer.packed_linear import stamp
from fitlm.models.decoder import DecoderModel, PreNormBlock
from fitlm.models.layers import GatedMLP, KVCache, RMSNorm, SelfAttention, causal_attention

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM

# Rows a C step takes. Its products run 8 rows per pass over each packed weight panel, so 16 rows read the
# weights once and multiply-add twice as much; it stays ahead of the torch step there (SmolLM2-135M, 2 cores, a
# step at 16 rows: fp32 20.6 against 29.0 ms, bf16 15.2 against 23.7), and beyond, oneDNN's GEMM takes over.
MAX_BATCH = {torch.float32: 16, torch.bfloat16: 16, torch.float16: 16}
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


def _projections(
    fused: nn.Linear | None, separate: list[Any], parts: list[int]
) -> list[tuple[tuple[torch.Tensor, torch.Tensor], int | None]]:
    """((Parameter, its rows), bias pointer or None) of each projection: consecutive row blocks of `fused`
    ([sum of parts, in], Phi-3's qkv_proj and gate_up_proj), else each of the `separate` Linears."""
    if fused is None:
        return [((m.weight, m.weight.data), None if m.bias is None else m.bias.data_ptr()) for m in separate]
    w, b, row = fused.weight, fused.bias, 0
    out: list[tuple[tuple[torch.Tensor, torch.Tensor], int | None]] = []
    for n in parts:
        out.append(((w, w.data[row : row + n]), None if b is None else b.data_ptr() + row * b.element_size()))
        row += n
    return out


PW = 32  # decode_step.c's panel: output rows per packed panel
# weight Parameter -> {(first row, rows): (its stamp when packed, the panels)}; weak, so a freed model frees them
_PANELS = WeakIdKeyDictionary()


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w [rows, n] in decode_step.c's packed layout: panels of PW output rows, [panels, n, PW] (bf16: [panels,
    ceil(n/2), PW, 2], an input pair side by side for the pair products), rows past the end zero."""
    rows, n = w.shape
    panels, odd = -(-rows // PW), n % 2 if w.dtype == torch.bfloat16 else 0
    padded = F.pad(w, (0, odd, 0, panels * PW - rows))  # [panels*PW, n (+1)]
    if w.dtype == torch.bfloat16:
        return padded.view(panels, PW, -1, 2).permute(0, 2, 1, 3).contiguous()  # [panels, n/2, PW, 2]
    return padded.view(panels, PW, n).transpose(1, 2).contiguous()  # [panels, n, PW]


def _cached_panels(param: torch.Tensor, rows: torch.Tensor) -> tuple[dict, tuple[int, int], bool]:
    """(param's cache, the key of `rows` in it, whether the cached panels are current)."""
    key = ((rows.data_ptr() - param.data_ptr()) // max(1, param.stride(0) * param.element_size()), rows.shape[0])
    cached = _PANELS.setdefault(param, {})
    hit = cached.get(key)
    return cached, key, hit is not None and hit[0] == stamp(param)


def panels_of(param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The packed panels of `rows` (a block of consecutive rows of `param`), cached on `param` and packed again
    when it changed since (packed_linear.stamp: an in-place update such as an optimizer step, new data, a cast)."""
    cached, key, current = _cached_panels(param, rows)
    if not current:
        with torch.no_grad():
            cached[key] = (stamp(param), pack_panels(rows.detach()))
    return cached[key][1]


def unpacked_bytes(weights: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes `panels_of` would allocate for these (Parameter, rows) that have no current panels yet."""
    return sum(rows.numel() * rows.element_size() for p, rows in weights if not _cached_panels(p, rows)[2])


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
        # per layer: pointers, and (Parameter, its rows) where a weight's packed panels go (see _pack)
        self.slots = [self._slots(block, i, cache, heads, kv_heads, d, ffn) for i, block in enumerate(layers)]
        self.head = (lm.lm_head.weight, lm.lm_head.weight.data)
        self.struct = _Model(
            dtype=DTYPES[self.dtype], layers=len(layers), hidden=cfg.hidden_size, heads=heads, kv_heads=kv_heads,
            head_dim=d, ffn=ffn, vocab=self.vocab, max_len=cache.max_len, window=attn0.window or 0,
            eps=lm.model.norm.eps, scale=attn0.scale if attn0.scale is not None else d**-0.5,
            embed=body.embed_tokens.weight.data_ptr(), final_norm=lm.model.norm.weight.data_ptr(),
        )  # fmt: skip
        # every (Parameter, rows) packed, and the Parameters whose versions `step` compares with the packing's
        self.weights = [s for slots in self.slots for s in slots if isinstance(s, tuple)] + [self.head]
        self.sources = [p for p, _ in self.weights]
        self.versions: tuple[tuple[int, int, torch.dtype], ...] = ()
        # The tensors the C struct points into, held so none is freed while it lives; `step` checks that the model
        # and the cache still use them (a weight or cache buffer swapped for another would leave a dangling pointer).
        self.kept = [*(p.data for p in model.parameters()), *cache.k, *cache.v]
        self.anchors = (body.embed_tokens.weight, lm.lm_head.weight)
        self.anchored = self._anchor_pointers()

    def _pack(self) -> None:
        """Point the struct at the weights' packed panels (decode_step.c's products read those), packing the ones
        that changed since; the versions they were packed at, for `step` to compare."""
        self.versions = tuple(stamp(p) for p in self.sources)
        self.packs = [panels_of(*s) if isinstance(s, tuple) else s for slots in self.slots for s in slots]
        self.pointers = (ctypes.c_void_p * len(self.packs))(
            *[p.data_ptr() if isinstance(p, torch.Tensor) else p for p in self.packs]
        )
        self.head_panels = panels_of(*self.head)
        self.struct.layer = ctypes.cast(self.pointers, ctypes.c_void_p)
        self.struct.head = self.head_panels.data_ptr()

    def _anchor_pointers(self) -> tuple[int, ...]:
        """Where the embedding, the head and the cache's first and last buffers are now."""
        return (*(p.data_ptr() for p in self.anchors), self.cache.k[0].data_ptr(), self.cache.v[-1].data_ptr())

    @staticmethod
    def _slots(block: Any, i: int, cache: KVCache, heads: int, kv: int, d: int, ffn: int) -> list[Any]:
        """decode_step.c's slots of one layer: a pointer (or None), or a weight's (Parameter, rows) to pack."""
        attn, mlp = block.self_attn, block.mlp  # (a PreNormBlock's SelfAttention and GatedMLP)
        qkv = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        (wq, bq), (wk, bk), (wv, bv) = _projections(getattr(attn, "qkv_proj", None), qkv, [heads * d, kv * d, kv * d])
        gate_up = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
        (wgate, _), (wup, _) = _projections(getattr(mlp, "gate_up_proj", None), gate_up, [ffn, ffn])
        o_bias = attn.o_proj.bias
        norm = {n: None if m is None else m.weight.data_ptr() for n, m in (("q", attn.q_norm), ("k", attn.k_norm))}
        return [
            block.input_layernorm.weight.data_ptr(), wq, wk, wv, bq, bk, bv,
            (attn.o_proj.weight, attn.o_proj.weight.data), None if o_bias is None else o_bias.data_ptr(),
            block.post_attention_layernorm.weight.data_ptr(), wgate, wup,
            (mlp.down_proj.weight, mlp.down_proj.weight.data), cache.k[i].data_ptr(), cache.v[i].data_ptr(),
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
        decoder = cls(model, cache, lib)
        need, free = unpacked_bytes(decoder.weights), available_host_memory()
        if free is not None and need > free // 2:  # (the rest for the KV cache, activations, the prefill's copies)
            warnings.warn(
                f"fitlm: the C decode step would copy {need / 2**30:.2f} GiB of weights into its packed layout and "
                f"{free / 2**30:.2f} GiB are free: keeping the torch step (FITLM_NATIVE=0 turns the C step off)",
                stacklevel=2,
            )
            return None
        decoder._pack()
        return decoder

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
        if tuple(stamp(p) for p in self.sources) != self.versions:
            self._pack()  # (a weight changed in place since: an optimizer step between decodes)
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
