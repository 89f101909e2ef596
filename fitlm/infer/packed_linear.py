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
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

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


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of `weight` [out, in], packed again if the weight changed since."""
    cached = _PACKED.get(weight)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # tuned for one row (decoding)
    _PACKED[weight] = (weight._version, packed)
    return packed


def _packed_forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if x.dtype != w.dtype or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
            return F.linear(x, w, module.bias)  # what nn.Linear does (no autograd through the packed copy)
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), module.bias, "none", [], "")  # [...,out]

    return forward


@contextmanager
def packed_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run `model`'s plain CPU `nn.Linear`s on oneDNN-packed weights while inside (see the module doc). `enabled`
    False: as they are (a training process, where the packed copies would hold the weights' bytes twice)."""
    dtypes = packable_dtypes() if enabled else set()
    patched = [
        m
        for m in model.modules()
        if type(m) is nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype in dtypes
        and type(m.weight.data) is torch.Tensor  # not a DTensor or another tensor subclass
        and "forward" not in m.__dict__  # already patched (nested use) or replaced by someone else
    ]
    for m in patched:
        m.forward = _packed_forward(m)  # type: ignore[method-assign]  # (an instance attribute, removed below)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


__all__ = ["packable_dtypes", "packed_linears", "packed_weight"]
