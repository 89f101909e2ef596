"""The global gradient norm and the clip by it, over whatever shards a rank holds.

`squared_norm` sums the squares of a rank's gradients: DTensor gradients (tensor parallel, FSDP2) are
reduced over their own mesh by torch's `get_total_norm`, plain tensors on the CPU as one BLAS dot product
each. On the CPU torch's per-tensor norm kernel reads fp32 gradients more slowly than a BLAS dot product
does, and the dot's accumulation is closer to the fp64 norm (bench/RESULTS.md, "Figures behind the code's design
choices").

`clip_by_norm` is torch's clip, skipping its in-place scaling (one more read and write of every gradient) in the
steps where the norm is within the bound and the factor is 1. (Folding the clip into fused AdamW as its
`grad_scale` divisor saves that pass in every step, but a division rounds differently from torch's
multiplication, and the single process must clip exactly as the sharded layouts do: their equivalence tests
compare final weights, where Adam amplifies a one-ulp difference in a near-zero gradient.)
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor

# torch.nn.utils.clip_grads_with_norm_'s guard against a zero norm.
CLIP_EPS = 1e-6


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of `grads` as an fp32 scalar; DTensor grads are reduced over their own mesh."""
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    buckets: dict[object, list[torch.Tensor]] = {}
    for g in grads:  # one norm per kind: foreach kernels cannot mix plain tensors and meshes
        buckets.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    for mesh, gs in buckets.items():
        if mesh is None and gs[0].device.type == "cpu":
            total = total + _cpu_squared_norm(gs)
            continue
        n = torch.nn.utils.get_total_norm(gs, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        total = total + n.float().to(total.device) ** 2
    return total


def _cpu_squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    sums = []
    for g in grads:
        flat = g.reshape(-1)  # a view for the contiguous gradients autograd produces
        if flat.dtype == torch.float32:
            sums.append(torch.dot(flat, flat))
        else:  # half gradients (O3): the sum in fp32, not rounded to half as torch's norm of half tensors is
            sums.append(torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2)
    return torch.stack(sums).sum()


def clip_by_norm(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """torch's clip (`clip_grads_with_norm_`: every gradient times min(1, max_norm / (norm + 1e-6))), without its
    pass over all the gradients when that factor is exactly 1 -- a multiplication by 1.0 changes no value -- on a
    CPU, where reading the factor costs nothing. The factor is computed and applied as torch does, as the sharded
    layouts (which clip with torch's clip_grad_norm_) do."""
    if not params or not 0 < max_norm < math.inf:  # grad_clip 0 (or inf): no clipping
        return
    factor = max_norm / (norm.float() + CLIP_EPS)  # as torch computes it (fp32)
    if norm.device.type == "cpu" and float(factor) >= 1.0:
        return
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def clip_each(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """`clip_by_norm`'s factor (torch's, min(1, max_norm / (norm + 1e-6)) in fp32) applied gradient by gradient,
    each on its local storage: for gradients of several kinds (plain tensors and DTensors of different meshes)
    that torch's foreach clip cannot take in one list."""
    if not params or not 0 < max_norm < math.inf:
        return
    factor = torch.clamp(max_norm / (norm.float() + CLIP_EPS), max=1.0)
    if float(factor) >= 1.0:
        return
    for p in params:
        g = p.grad
        if g is not None:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(float(factor))
