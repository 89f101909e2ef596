"""Tensor parallel inside each expert (Megatron-Core's expert tensor parallel): a routed block's experts split on
their width I over the tp ranks, as a dense MLP is.

One routed block (`fitlm.models.moe.MoEFeedForward`) on a tp rank, N tokens of the tp group's sequence:
  1. its input gathered to the full sequence [N, H] (as every tp sub-block's); the router runs on it whole, the same
     on every rank (a replicated weight: the same logits, loads, aux loss and bias as one process);
  2. every routed slot runs through this rank's shard of its expert: gate/up rows [I/tp, H] and down columns
     [H, I/tp] (`GroupedExperts` computes on the local shards as they are), a partial sum of the expert's output;
     Qwen2-MoE's shared expert is column- then row-parallel as a dense MLP, its output a partial sum too;
  3. the partial sums reduced once: reduce-scattered onto the rank's part of the sequence under sequence parallel,
     all-reduced without.

Backward: the routed slots' input rows, their routing weights and the shared expert's gate get partial gradients
(each rank saw its shard of every expert); `SumGradOverTp` all-reduces those over tp, so the router's and the
input's gradients are whole and equal on every rank, as the router's own (aux loss) gradient already is: the
router's weight needs no reduction, and the gathered input's gradient is sliced as any replicated one.

Adapters on the experts (fitlm.finetune.expert_lora) split with their bases as a column-/row-parallel Linear's do
(fitlm.parallel.lora_parallel): B of gate/up and A of down sharded on I, A of gate/up and B of down replicated. The
replicated ones' gradients are partial sums, all-reduced over tp once a step (`sync_split_expert_gradients`).

Expert parallel on top (fitlm.parallel.expert_parallel) splits dim 0 over "ep" as well: the stacked weights become
DTensors on the 2-D ("ep", "tp") mesh, (Shard(0), this module's placement). Checkpoints and the full state dict see
the global tensors, so a run resumes on any other layout.

Why split rather than replicate the experts over tp: docs/moe.md, "Tensor parallel" (bench/moe_tp.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from fitlm.models.experts import PROJECTIONS
from fitlm.models.moe import MoEFeedForward
from fitlm.parallel.collective_trace import collective
from fitlm.parallel.lora_parallel import LoraColwiseParallel, LoraRowwiseParallel, has_adapter
from fitlm.parallel.tp_styles import FirstArgLayout

# Set on the GroupedExperts this module split: their tp mesh (the mark survives `to_empty`, which replaces the
# Parameter objects).
SPLIT_ATTR = "_fitlm_experts_split_over_tp"
# Stacked expert parameters and the dim each is split on over tp: gate/up [E, I, H] on I, down [E, H, I] on I; an
# adapter's factor on I with its base (B of gate/up [E, I, r], A of down [E, r, I]). The others (A of gate/up
# [E, r, H], B of down [E, H, r]) are replicated, with partial-sum gradients (`PARTIAL_GRADIENTS`).
SPLIT_DIMS = {
    "gate_proj": 1,
    "up_proj": 1,
    "down_proj": 2,
    "lora_B_gate_proj": 1,
    "lora_B_up_proj": 1,
    "lora_A_down_proj": 2,
}
PARTIAL_GRADIENTS = ("lora_A_gate_proj", "lora_A_up_proj", "lora_B_down_proj")
assert all(name.split("_", 2)[2] in PROJECTIONS for name in PARTIAL_GRADIENTS)


def split_placement(name: str) -> Placement:
    """The tp placement of the stacked expert parameter `name` (a base projection or an adapter factor)."""
    return Shard(SPLIT_DIMS[name]) if name in SPLIT_DIMS else Replicate()


class SumGradOverTp(torch.autograd.Function):
    """Identity in forward; in backward the gradient summed over the tp group: what the partial sums each rank's
    expert shards give the tensor's gradient add up to (module docstring)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        summed = grad.contiguous().clone()  # (the incoming gradient may be shared, or an expanded view)
        with collective("all-reduce", "a routed block's input gradient", "tp", summed):
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=ctx.group)
        return summed, None


class SumGrad:
    """`MoEFeedForward.partial_grad` under split experts: `SumGradOverTp` on the tp group of `mesh`."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return SumGradOverTp.apply(t, self.group)


class SplitExperts(ParallelStyle):
    """The style of a routed block's `mlp` (module docstring): input gathered from the residual stream's layout
    `act` to the full sequence, the experts (and a shared expert) split inside over tp, the partial output reduced
    back to `act` (Shard(1): reduce-scatter; Replicate: all-reduce)."""

    def __init__(self, act: Placement):
        self.act = act

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, MoEFeedForward)  # (the plan gives this style to routed blocks only)
        FirstArgLayout(self.act, Replicate(), to_local=True)._apply(module, device_mesh)
        experts = module.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.data, device_mesh, [split_placement(name)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        setattr(experts, SPLIT_ATTR, device_mesh)
        if hasattr(module, "shared_expert"):
            parallelize_module(module.shared_expert, device_mesh, _shared_expert_plan(module.shared_expert))
        module.partial_grad = SumGrad(device_mesh)

        def output(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            partial = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False)
            return partial.redistribute(placements=(self.act,)).to_local()

        module.register_forward_hook(output)
        return module


def _shared_expert_plan(mlp: nn.Module) -> dict[str, ParallelStyle]:
    """Qwen2-MoE's shared expert as a dense MLP's column-/row-parallel split, its output left a partial sum (the
    routed block reduces it with the experts' in one collective). A LoRA-adapted Linear splits its adapter too."""

    def colwise(name: str) -> ParallelStyle:
        return LoraColwiseParallel() if has_adapter(mlp.get_submodule(name)) else ColwiseParallel()

    rowwise = LoraRowwiseParallel if has_adapter(mlp.get_submodule("down_proj")) else RowwiseParallel
    plan: dict[str, ParallelStyle] = {"down_proj": rowwise(output_layouts=Partial())}
    for name in ("gate_proj", "up_proj"):
        plan[name] = colwise(name)
    return plan


def split_mesh(experts: nn.Module) -> DeviceMesh | None:
    """The tp mesh `SplitExperts` split these experts over; None if it did not."""
    return getattr(experts, SPLIT_ATTR, None)


def sync_split_expert_gradients(modules: list[nn.Module]) -> None:
    """Sum over tp the gradients of the replicated adapter factors of split experts (`PARTIAL_GRADIENTS`): each
    rank's is the partial sum from its shard of the expert. Once a step, after the last micro batch's backward."""
    for m in modules:
        for sub in m.modules():
            mesh = split_mesh(sub)
            if mesh is None:
                continue
            for name in PARTIAL_GRADIENTS:
                p = getattr(sub, name, None)
                if p is None or p.grad is None:
                    continue
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                with collective("all-reduce", f"the gradient of experts.{name}", "tp", local):
                    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=mesh.get_group())
