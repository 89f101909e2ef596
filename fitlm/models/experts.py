"""The stacked experts of a mixture-of-experts layer (`GroupedExperts`) and how their products run: torch's grouped
matmul where it has a kernel (`grouped_mm_supported`), else one matmul pair per expert (`expert_loop`).

Shape letters as in fitlm.models.moe: M routed rows of the call, H model width, E experts (this rank's under expert
parallel), I expert width (this rank's 1/tp under tensor parallel), r an adapter's rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: down(silu(gate(x)) · up(x)) with gate_proj, up_proj [E, I, H] and
    down_proj [E, H, I] (row e is expert e's nn.Linear weight under HF's per-expert names).

    A projection may carry a LoRA adapter (fitlm.finetune.expert_lora attaches it): stacked `lora_A_<proj>`
    [E, r, in] and `lora_B_<proj>` [E, out, r], so expert e computes W_e·x + scaling · B_e·A_e·x, as PEFT's
    LoRA on each expert's nn.Linear does. They are parameters of this module, so expert parallel splits them
    with the experts."""

    def __init__(self, num_experts: int, hidden: int, inner: int, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.num_experts = num_experts  # E of the whole layer (expert parallel's ranks hold E/ep of the rows)
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.lora_scaling, self.lora_dropout = 1.0, 0.0  # of the adapters, when attached
        # How expert e's [out, in] is read from a stacked weight stored in another form (QLoRA's 4-bit NF4, 2-D
        # [E·out, in]: fitlm.finetune.qlora sets fitlm.memory.nf4.expert, a view of its codes that F.linear
        # dequantizes); None: plain stacked tensors, row e. Set, the experts run in the loop, one expert's weight
        # at full width.
        self.take: Callable[[torch.Tensor, int], torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(w, 0.0, self.init_std)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [M, H], rows grouped by expert in order (counts[e] rows for expert e of this rank's experts) -> [M, H].

        Three grouped matmuls (`torch.nn.functional.grouped_mm`: gate, up, down over all experts at once, the
        groups cut by the cumulative counts; an adapted projection adds its A and B as two more grouped products)
        where torch has the kernel for the device and dtype (`grouped_mm_supported`), else one matmul pair per
        expert that has rows (`_expert_loop`), which also runs QLoRA's 4-bit experts (`take`) one at a time. Both give
        the same results (on CPU the grouped kernel runs a matmul per group as the loop does: equal to float
        rounding); experts with no row get a zero gradient slice. Under expert parallel the weights are DTensors
        sharded on the expert dimension and this rank computes its own E/ep experts
        (fitlm.parallel.expert_parallel)."""
        gate, up, down = (_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        lora = self._adapters()
        dtype = _compute_dtype(x)
        traced = is_fake(x) or torch.compiler.is_compiling()
        ranks = [a.shape[1] for a, _ in lora.values()]  # the adapters' [M, r] rows are the kernel's operands too
        aligned = _aligned(dtype, gate.shape[-1], gate.shape[-2], *ranks)  # the kernel's strides: 16-byte multiples
        grouped = x.shape[0] > 0 and aligned and grouped_mm_supported(x.device, dtype, traced=traced)  # (no row: loop)
        if grouped and self.take is None:
            return _grouped(x, counts, {"gate_proj": gate, "up_proj": up, "down_proj": down}, dtype, self._delta(lora))
        # the loop: no kernel, or weights read one expert at a time (QLoRA), each expert's A and B beside its weight
        return _expert_loop(x, counts, gate, up, down, partial(self._project, lora=lora))

    def stacked_shape(self, proj: str) -> tuple[int, int, int]:
        """The [E, out, in] of projection `proj` whatever its storage: QLoRA keeps the 4-bit codes 2-D as
        [E·out, in] (the same flat order; FSDP2 shards them by rows), which the gathered weights (the final save,
        the merge and the export) read back under this shape; a checkpoint leaves the 4-bit base out."""
        shape = tuple(getattr(self, proj).shape)
        if len(shape) == 3:
            return shape
        return (self.num_experts, shape[0] // self.num_experts, shape[1])

    def _adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (A, B) of every adapted projection; none while adapters are switched off (DPO's reference)."""
        if getattr(self, "lora_off", False):
            return {}
        return {
            p: (_local(getattr(self, f"lora_A_{p}")), _local(getattr(self, f"lora_B_{p}")))
            for p in PROJECTIONS
            if hasattr(self, f"lora_A_{p}")
        }

    def _delta(self, lora: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Callable | None:
        """The adapters' term on the grouped path: delta(rows, proj, product) = scaling · B_e·A_e·rows for every
        group e, two grouped products ([M, in] -> [M, r] -> [M, out]); None without adapters."""
        if not lora:
            return None

        def delta(rows: torch.Tensor, proj: str, product: Callable) -> torch.Tensor | None:
            if proj not in lora:
                return None
            a, b = lora[proj]  # [E, r, in], [E, out, r]
            if self.lora_dropout > 0 and self.training:
                rows = F.dropout(rows, self.lora_dropout, training=True)
            return product(product(rows, a), b) * self.lora_scaling

        return delta

    def _project(self, x: torch.Tensor, w: torch.Tensor, e: int, proj: str, lora: dict) -> torch.Tensor:
        """x [m, in] through expert e's `proj` [out, in], plus its adapter's scaling · B_e·A_e·x where it has one."""
        y = F.linear(x, w[e] if self.take is None else self.take(w, e))
        if proj not in lora:
            return y
        a, b = lora[proj]
        if self.lora_dropout > 0 and self.training:
            x = F.dropout(x, self.lora_dropout, training=True)
        return y + F.linear(F.linear(x, a[e]), b[e]) * self.lora_scaling


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, traced: bool = False) -> bool:
    """Whether `GroupedExperts` computes with torch's grouped matmul on `device` in `dtype` (decided by the
    device, its capability and torch's version; no call is tried).

    * CUDA: bf16 on compute capability 8.0+ (torch 2.9+; torch 2.8's kernel is Hopper-only, 9.x), the
      kernels' documented inputs; fp32 and fp16 take the per-expert loop.
    * CPU: torch 2.11+ (2.8 has no CPU kernel, 2.9-2.10's needs 16-byte aligned operands, which a
      memory-mapped checkpoint does not promise), any float dtype: the kernel is a matmul per group in C++,
      the loop's results without its per-expert Python and autograd nodes.
    * `traced` (torch.compile, or the planner's fake tensors): bf16 only, the dtype torch's shape function
      for the op accepts there.
    * other devices: the loop."""
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return False
    if traced and dtype != torch.bfloat16:
        return False
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])  # (major, minor)
    if device.type == "cuda":
        if dtype != torch.bfloat16 or not torch.cuda.is_available():
            return False
        capability = torch.cuda.get_device_capability(device)
        return capability >= (8, 0) if version >= (2, 9) else capability[0] == 9
    if device.type == "cpu":
        return version >= (2, 11) and dtype in (torch.float32, torch.bfloat16, torch.float16)
    return False


def _aligned(dtype: torch.dtype, *widths: int) -> bool:
    """Rows of these widths are 16-byte multiples in `dtype`: the grouped kernels refuse other strides (H and I
    of real models are; some test shapes are not)."""
    size = torch.empty((), dtype=dtype).element_size()
    return all(w * size % 16 == 0 for w in widths)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute x in here: autocast's where it is on for x's device, else x's."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _grouped(
    x: torch.Tensor, counts: list[int], weights: dict[str, torch.Tensor], dtype: torch.dtype, delta=None
) -> torch.Tensor:
    """The experts as three grouped matmuls over x [M, H]; `offs` [E] int32 is where each expert's rows end.
    `delta(rows, proj, product)` (GroupedExperts._delta): an adapter's term added to a projection, computed with
    the same grouped `product`. The op is not under autocast: operands are cast to the dtype F.linear would
    compute in (`dtype`)."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)

    def product(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # [E, out, in] weights as [E, in, out] (the transposed, column-major view the kernels take): rows @ w_e.T
        return grouped_mm(rows, w.to(dtype).transpose(-2, -1), offs=offs)

    def project(rows: torch.Tensor, proj: str) -> torch.Tensor:
        y = product(rows, weights[proj])
        extra = delta(rows, proj, product) if delta is not None else None
        return y if extra is None else y + extra

    x = x.to(dtype)
    h = F.silu(project(x, "gate_proj")) * project(x, "up_proj")  # [M, I]
    return _ContiguousGrad.apply(project(h, "down_proj"))  # [M, H]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the grouped matmul's backward refuses an
    expanded one (e.g. of `out.sum()`, strides 0); a no-op for the gradient `dispatch` sends back."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _linear(x: torch.Tensor, w: torch.Tensor, e: int, proj: str) -> torch.Tensor:
    return F.linear(x, w[e])


def _expert_loop(
    x: torch.Tensor,
    counts: list[int],
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    project: Callable[[torch.Tensor, torch.Tensor, int, str], torch.Tensor] = _linear,
) -> torch.Tensor:
    """One matmul pair per expert that has rows (where torch has no grouped matmul for the device/dtype, or the
    experts carry adapters: `project(x, weight, e, name)` runs one projection of expert e)."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        if rows.shape[0]:
            h = F.silu(project(rows, gate, e, "gate_proj")) * project(rows, up, e, "up_proj")  # [m, I]
            outs.append(project(h, down, e, "down_proj"))  # [m, H]
    if not outs:
        # No row at all (an expert rank whose experts got no token): a zero-row pass through expert 0 keeps
        # the graph through this call and gives the weights (and adapters) a zero gradient, so the backward's
        # all-to-alls and the gradient reductions still run on this rank as on the others.
        rows = x[:0]
        h = F.silu(project(rows, gate, 0, "gate_proj")) * project(rows, up, 0, "up_proj")
        outs.append(project(h, down, 0, "down_proj"))
    return torch.cat(outs)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight (all of them unless expert parallel split it)."""
    return w.to_local() if isinstance(w, DTensor) else w
