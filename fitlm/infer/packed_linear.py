"""oneDNN-prepacked Linear weights for decoding on a CPU: the same products, without a reorder per call.

Why: at batch 1 a decode step is one matrix-vector product per weight, bound by how fast the weights
stream from memory. torch's bf16 `F.linear` on a CPU calls oneDNN, which reorders the plain [out, in]
weight into its blocked layout on every call, so bf16 decoding read (and wrote) each weight more than
once and was no faster than fp32. Packing once (`torch.ops.mkldnn._reorder_linear_weight`, what
inductor's CPU freezing does) and calling `_linear_pointwise` on the packed copy reads each weight once
per step in half the bytes of fp32. fp32 gains too (fewer bytes moved per product, the vocabulary
projection most). bf16 results are bit-identical to `F.linear`'s (the same oneDNN kernel); fp32 ones
differ by float rounding (another kernel's summation order).

Where it applies: `packed_linears(model)` is a context manager the decoders (`generate`, `SlotBatch`)
enter. Inside it, every plain `nn.Linear` on the CPU whose weight dtype oneDNN handles here (fp32; bf16 /
fp16 where the CPU has the instructions) runs on a packed copy; anything else (subclasses such as
quantized layers, GPU, grad-enabled calls, inputs of another dtype) keeps `nn.Linear.forward`. The
packed copies are cached per weight tensor and rebuilt when the weight changes (its version counter
moves on an in-place update, e.g. an optimizer step), so a model that trains between decodes never
decodes with stale weights. Cost: one packed copy of each weight while the model lives (the packed
bytes of the weights; a tied head gets its own copy). `FITLM_PACKED_LINEAR=0` turns it off.

The weights are packed without a batch-size hint: oneDNN's layout for a hint of 1 row made fp32 products
slower, not faster (1 thread, fp32: 20-30% slower at one row, ~40% at 8 rows, the 49,152-row head 3.7 against
2.9 ms; bf16 the same either way).

Products that read the same input are fused: an attention's q/k/v projections run as one packed [(H+2K)·D, C]
product and a gated MLP's gate/up as one [2F, C] (both packed, as Phi-3 stores them), then split. Why: a
oneDNN call costs ~12 µs besides its bytes and small products stream slower than big ones (1 thread, fp32:
576-row products at ~19 GB/s, 1536-row ~25, 3072-row and more ~25-30), so 7 products per layer become 4.
bf16 outputs equal the separate products' bit for bit (fp32: to float rounding). Only where all of a group
are plain packable `nn.Linear`s without hooks (a LoRA-wrapped or hooked projection keeps its own call).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from fitlm.models.layers import GatedMLP, SelfAttention

# weight -> (its version when packed, the packed copy), by identity (tensors' == is elementwise); weak, so
# a freed model frees its packed copies
_PACKED = WeakIdKeyDictionary()


def packable_dtypes() -> set[torch.dtype]:
    """The weight dtypes this CPU's oneDNN packs (empty when torch was built without it, or it is turned off)."""
    if os.environ.get("FITLM_PACKED_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return set()
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.add(torch.float16)
    return dtypes


def _version(t: torch.Tensor) -> int:
    """t's in-place update counter; inference tensors (a model loaded under inference mode) have none, and can
    only change inside inference mode, where nothing else would see it either: their identity stands for them."""
    return -1 if t.is_inference() else t._version


def stamp(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    """What a packed copy of `t` was made from: its version (in-place updates), its storage and dtype
    (`param.data = ...` and `model.to(dtype)` keep the Parameter, and may keep a version of 0)."""
    return _version(t), t.data_ptr(), t.dtype


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of `weight` [out, in], packed again if the weight changed since."""
    cached = _PACKED.get(weight)
    if cached is not None and cached[0] == stamp(weight):
        return cached[1]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())  # no batch-size hint (see the module doc)
    _PACKED[weight] = (stamp(weight), packed)
    return packed


def packed_rows(owner: nn.Module, linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(packed weight, bias) of `linears` stacked by rows ([sum of outs, in], [sum of outs] or None), cached on
    `owner`; made again when any weight or bias changed (an in-place update, or another tensor put in its place)."""
    tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]
    made_from = tuple((id(t), *stamp(t)) for t in tensors)
    cached = _PACKED.get(owner)
    if cached is not None and cached[0] == made_from:
        return cached[1]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in linears]))
        bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    _PACKED[owner] = (made_from, (packed, bias))
    return packed, bias


def _grad_free(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """True when a call with input x may skip autograd: the packed copies have none."""
    return not torch.is_grad_enabled() or not (x.requires_grad or any(w.requires_grad for w in weights))


def _packed_forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if x.dtype != w.dtype or not _grad_free(x, [w]):
            return F.linear(x, w, module.bias)  # what nn.Linear does (no autograd through the packed copy)
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), module.bias, "none", [], "")  # [...,out]

    return forward


def _fused_product(owner: nn.Module, linears: list[nn.Linear], x: torch.Tensor) -> torch.Tensor | None:
    """x [...,in] through `linears` as one packed product: [..., sum of outs]; None where the call must keep
    the separate products (another dtype, or autograd)."""
    if x.dtype != linears[0].weight.dtype or not _grad_free(x, [m.weight for m in linears]):
        return None
    weight, bias = packed_rows(owner, linears)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _fused_project(attn: SelfAttention):
    """SelfAttention.project with q/k/v as one product (the layout of Phi-3's qkv_proj, split the same way)."""
    linears = [attn.q_proj, attn.k_proj, attn.v_proj]
    heads = [m.out_features // attn.head_dim for m in linears]  # (local heads under tensor parallel)

    def project(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = _fused_product(attn, linears, x)  # [B,T,(H+2K)·D]
        if qkv is None:
            return type(attn).project(attn, x)
        q, k, v = qkv.view(*x.shape[:2], -1, attn.head_dim).split(heads, dim=2)  # [B,T,H,D], [B,T,K,D] x2
        return q, k, v

    return project


def _fused_mlp(mlp: GatedMLP):
    """GatedMLP.forward with gate/up as one product (the layout of Phi-3's gate_up_proj)."""
    linears = [mlp.gate_proj, mlp.up_proj]

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate_up = _fused_product(mlp, linears, x)  # [B,T,2F]
        if gate_up is None:
            return type(mlp).forward(mlp, x)
        gate, up = gate_up.chunk(2, dim=-1)  # [B,T,F] each
        return mlp.down_proj(mlp.act(gate) * up)

    return forward


# The fused groups: (module class, the method replaced, its maker, the projections that read the same input).
_GROUPS = (
    (SelfAttention, "project", _fused_project, ("q_proj", "k_proj", "v_proj")),
    (GatedMLP, "forward", _fused_mlp, ("gate_proj", "up_proj")),
)


def _packable(m: nn.Module, dtypes: set[torch.dtype]) -> bool:
    return (
        type(m) is nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype in dtypes
        and type(m.weight.data) is torch.Tensor  # not a DTensor or another tensor subclass
        and "forward" not in m.__dict__  # already patched (nested use) or replaced by someone else
    )


def _fusable(m: nn.Module, dtypes: set[torch.dtype]):
    """(the method of `m` to replace by a fused product, its maker), or None (not a group, or a member that must
    keep its call)."""
    for cls, method, make, names in _GROUPS:
        if isinstance(m, cls) and method not in m.__dict__ and all(hasattr(m, n) for n in names):
            linears = [getattr(m, n) for n in names]
            if (
                all(_packable(lin, dtypes) and not lin._forward_hooks and not lin._forward_pre_hooks for lin in linears)
                and len({lin.weight.dtype for lin in linears}) == 1
                and len({lin.bias is None for lin in linears}) == 1
            ):
                return method, make
    return None


@contextmanager
def packed_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run `model`'s plain CPU `nn.Linear`s on oneDNN-packed weights while inside, q/k/v and gate/up fused (see the
    module doc). `enabled` False: as they are (a training process, where the packed copies would hold the weights'
    bytes twice)."""
    dtypes = packable_dtypes() if enabled else set()
    modules = list(model.modules())
    fused = [(m, *group) for m in modules if (group := _fusable(m, dtypes)) is not None]
    linears = [m for m in modules if isinstance(m, nn.Linear) and _packable(m, dtypes)]
    for m, method, make in fused:
        setattr(m, method, make(m))  # an instance attribute, removed below
    for m in linears:
        m.forward = _packed_forward(m)  # type: ignore[method-assign]  # (an instance attribute, removed below)
    try:
        yield
    finally:
        for m, method, _ in fused:
            delattr(m, method)
        for m in linears:
            del m.forward


__all__ = ["packable_dtypes", "packed_linears", "packed_rows", "packed_weight"]
