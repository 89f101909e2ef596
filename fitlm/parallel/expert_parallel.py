"""Expert parallel: each MoE layer's E experts split E/ep per rank over the mesh's "ep" ranks, tokens moved to
their experts and back by all-to-all with uneven splits.

The ep ranks are carved out of data parallel (fitlm.parallel_dims.EXPERT_DIMS: dp = edp x ep), so every rank still
reads its own micro batches, runs attention and the router on its own tokens, and holds whole copies of the dense
parameters. Only the stacked expert weights ([E, I, H] / [E, H, I]) become DTensors sharded on dim 0 over "ep":
checkpoints (torch.distributed.checkpoint) and the full state dict see the global tensors, so a run resumes on
another expert-parallel degree as it does on another layout.

One MoE layer's forward on a rank (N local tokens, k slots each; El = E/ep local experts):
  1. route locally, sort the N·k slots by expert: they are then grouped by destination rank too;
  2. all-to-all the [ep, El] slot counts, then the [N·k, H] rows (uneven splits), received ordered
     (source rank, local expert); regroup them by local expert and run this rank's experts;
  3. undo the regrouping, all-to-all the rows back, weight them and add them to their tokens.
The backward of an all-to-all is the all-to-all with the splits swapped (`_AllToAll`).

Capacity (model.capacity_factor): the capacity is per expert over the slots the whole ep group sends it in one
forward, C = ceil(capacity_factor · N·k / E) with N the ep group's tokens, the earliest first in (ep rank, token)
order: what one process keeps of the ep ranks' tokens concatenated. Every rank all-gathers the [E] slot counts
(`ExpertParallelDispatch.kept_slots`), so each knows how many of its slots each expert keeps and sends only those.

Gradients: each rank's loss is scaled so that averaging over the dp ranks gives the global mean's gradient
(fitlm.parallel.data_parallel). An expert's gradient already holds every ep rank's tokens (the all-to-all's
backward brings them), so it is summed over the ranks holding the same experts ("edp"; under context parallel
"edp_cp", whose cp ranks route the other parts of the same sequences) and divided by dp (dp x cp), the
same divisor as every other gradient. Dividing by edp instead (an average over the expert's replicas) would scale
expert gradients by ep: pytorch#160285.

ZeRO-2/3 with replicas (edp > 1): the experts are sharded once more, by FSDP2 over "edp" (torchtitan's
dp_shard_mod_ep): each [E, ...] weight becomes a DTensor over the 2-D (edp, ep) mesh, (_StridedShard(0), Shard(0)),
so a rank keeps E / (ep · edp) experts' parameters (ZeRO-3), gradients and optimizer states (ZeRO-2 and 3). FSDP2's
reduce-scatter averages over edp, so `sync_expert_gradients` scales by edp / dp = 1 / ep afterwards (gloo has no
pre-multiplied sum to fold it into the reduce-scatter).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fitlm.memory import nf4
from fitlm.models.experts import GroupedExperts
from fitlm.models.moe import capacity, capacity_kept, first_slots, moe_layers, slot_counts
from fitlm.parallel.collective_trace import collective
from fitlm.parallel.mesh import ParallelContext

# Set on the GroupedExperts modules this module split (not on their parameters: materializing a meta model
# replaces every Parameter object, `to_empty`, and would drop the mark).
_EXPERT = "_fitlm_expert_parallel"
_SHARDED = "_fitlm_experts_over_edp"  # set on the GroupedExperts that FSDP2 shards over "edp" too


class _AllToAll(torch.autograd.Function):
    """Rows of x [sum(send), H] sent to the group's ranks (send[r] rows to rank r), received as [sum(recv), H]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    with collective("all-to-all", "the tokens of an MoE layer", "ep", out):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class ExpertParallelDispatch:
    """fitlm.models.moe.dispatch over the ep group: same arguments and results, experts on their ranks."""

    def __init__(self, group: dist.ProcessGroup, ep: int, capacity_factor: float | None = None):
        self.group, self.ep, self.capacity_factor = group, ep, capacity_factor
        # The planner's simulation only (fake tensors, fitlm.plan.simulate): this rank's experts receive this many
        # times their balanced rows (fitlm.plan.routing's worst case), capped as routing allows (`_received`).
        self.imbalance = 1.0

    def kept_slots(self, counts: torch.Tensor, split: list[int], capacity_factor: float) -> list[int]:
        """This rank's slots per (global) expert kept under the capacity over the ep group (module docstring)."""
        if is_fake(counts):  # the planner's simulation: every rank's even split, each keeping its share of C
            return [min(n, capacity(capacity_factor, sum(split) * self.ep, len(split)) // self.ep) for n in split]
        every = [torch.empty_like(counts) for _ in range(self.ep)]
        dist.all_gather(every, counts, group=self.group)
        kept = capacity_kept(torch.stack(every), capacity_factor)  # [ep, E]
        return kept[dist.get_rank(self.group)].tolist()

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts_of: torch.Tensor,
        experts: GroupedExperts,
        kept: list[int] | None = None,
    ):
        n, k = experts_of.shape
        e = experts.num_experts  # the global expert count
        flat = experts_of.reshape(-1)  # [N·k]
        order = flat.argsort(stable=True)
        counts, split = slot_counts(flat, e)  # [E] slots of this rank's tokens per (global) expert
        if kept is not None:  # a capacity: only the slots their experts keep leave (`kept_slots`)
            order, split = order[first_slots(split, kept, flat.device)], kept
        token = order // k
        if is_fake(flat):
            send, recv, local, regroup = self._simulated(split, n, k)
        else:
            send, recv, local, regroup = self._exchanged(split, counts)
        rows = _AllToAll.apply(x[token], send, recv, self.group)  # [R, H] ordered (source rank, local expert)
        out = experts(rows[regroup], local)  # [R, H], rows ordered (local expert, source rank)
        out = out[regroup.argsort()]  # back to (source rank, local expert)
        out = _AllToAll.apply(out, recv, send, self.group)  # [N·k, H] in the sorted slot order
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype)), counts

    def _exchanged(self, split: list[int], counts: torch.Tensor):
        """(rows sent to each rank, received from each, this rank's rows per local expert, the permutation
        ordering the received rows by local expert), from the slot counts the ranks exchange."""
        e = len(split)
        send_counts = torch.tensor(split, dtype=counts.dtype, device=counts.device).view(self.ep, e // self.ep)
        recv_counts = torch.empty_like(send_counts)  # [ep, El]: from rank s, for this rank's local experts
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.sum(dim=1).tolist(), recv_counts.sum(dim=1).tolist()
        return send, recv, recv_counts.sum(dim=0).tolist(), by_local_expert(recv_counts)

    def _simulated(self, split: list[int], tokens: int, k: int):
        """`_exchanged` under the planner's simulation (fake tensors: no counts to exchange). Balanced, every rank
        routes as this one, its slots split evenly over the experts, so it receives from each rank what it sends
        itself; with an imbalance, this rank is the most loaded one and receives `_received` rows. The regrouping
        is a permutation of the received rows (its values do not matter)."""
        local_experts = len(split) // self.ep
        mine = split[dist.get_rank(self.group) * local_experts :][:local_experts]  # this rank's experts' slots
        send = [sum(split[r * local_experts :][:local_experts]) for r in range(self.ep)]
        rows = self._received(sum(mine) * self.ep, tokens, k, local_experts)  # `tokens`: this rank's N
        # The received rows spread evenly over the source ranks and this rank's experts, and what it sends stays
        # its own slots: only the sums are buffers' rows (a real skew also moves its sends to the loaded rank)
        local = [c * self.ep for c in mine] if rows == sum(mine) * self.ep else _even(rows, local_experts)
        return send, _even(rows, self.ep), local, torch.arange(rows)

    def _received(self, balanced: int, tokens: int, k: int, local_experts: int) -> int:
        """Rows this rank's experts receive: `imbalance` times the `balanced` ones (the ep group's even split),
        at most what routing can bring them (fitlm.plan.routing's bounds): every token of the ep group choosing
        min(k, El) of them, or, under a capacity, C = ceil(cf · N·k · ep / E) slots per expert; N = `tokens`."""
        if self.imbalance == 1:
            return balanced
        most = self.ep * tokens * min(k, local_experts)
        if self.capacity_factor is not None:
            c = capacity(self.capacity_factor, tokens * k * self.ep, local_experts * self.ep)
            most = min(most, local_experts * c)
        return max(balanced, min(round(self.imbalance * balanced), most))


def _even(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes that differ by at most one."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def by_local_expert(counts: torch.Tensor) -> torch.Tensor:
    """Rows received in (source rank, local expert) blocks of sizes counts [ep, El] -> the permutation that orders
    them by (local expert, source rank), so each local expert's rows are contiguous."""
    sizes = counts.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # [ep·El] where each (s, j) block begins
    lengths = counts.t().reshape(-1)  # [El·ep] the blocks in (j, s) order
    first = starts.view(counts.shape).t().reshape(-1)
    within = torch.arange(int(lengths.sum()), device=counts.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    return torch.repeat_interleave(first, lengths) + within


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Split every MoE layer's stacked experts of `model` over the 1-D `ep_mesh` (Shard(0)) and route its tokens
    through `ExpertParallelDispatch`. Every rank holds the same full weights beforehand (or meta ones, filled by
    fitlm.parallel.materialize with each rank's slice). Experts tensor parallel already split inside
    (fitlm.parallel.expert_tensor_parallel) are split over both, on `ep_tp_mesh`, the 2-D ("ep", "tp") mesh."""
    for layer in moe_layers([model]):
        experts = layer.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(_over_ep(p, ep_mesh, ep_tp_mesh), requires_grad=p.requires_grad)
            setattr(experts, name, sharded)
        setattr(experts, _EXPERT, True)
        dispatcher = ExpertParallelDispatch(ep_mesh.get_group(), ep_mesh.size(), layer.capacity_factor)
        layer.dispatcher = dispatcher
        layer.kept = dispatcher.kept_slots
    return model


def _over_ep(p: torch.Tensor, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None) -> DTensor:
    """A stacked expert weight split on dim 0 over "ep": whole experts (a plain tensor) on `ep_mesh`; split inside
    over tp already (a DTensor on "tp") on `ep_tp_mesh`, (Shard(0), its tp placement)."""
    if not isinstance(p, DTensor):
        return distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
    assert ep_tp_mesh is not None  # (the trainer passes it under tensor parallel)
    # this rank's tp part [E, ...] already holds its (ep, tp) block: its ep-th of the experts, no communication;
    # a copy, so the other experts' storage is freed with the tp part
    mine = p.to_local().detach().chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()].clone()
    placements = [Shard(0), *p.placements]
    return DTensor.from_local(mine, ep_tp_mesh, placements, run_check=False, shape=p.shape, stride=p.stride())


def simulate_imbalance(modules: list[nn.Module], factor: float) -> None:
    """The planner's simulation of a worst case (fitlm.plan.simulate): every expert-parallel MoE layer of `modules`
    gives this rank's experts `factor` times their balanced rows (`ExpertParallelDispatch._received`)."""
    for layer in moe_layers(modules):
        if isinstance(layer.dispatcher, ExpertParallelDispatch):
            layer.dispatcher.imbalance = factor


def expert_parameters(modules: list[nn.Module], whole_only: bool = False) -> list[nn.Parameter]:
    """The expert-parallel parameters of `modules` (what data parallel leaves to `sync_expert_gradients`);
    `whole_only`: those that no FSDP2 unit shards over "edp" (each rank's whole)."""
    return [
        p
        for m in modules
        for sub in m.modules()
        if getattr(sub, _EXPERT, False) and not (whole_only and getattr(sub, _SHARDED, False))
        for p in sub.parameters(recurse=False)
    ]


def expert_shard_placement(model: nn.Module, ranks: int) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2's `shard_placement_fn` over `ranks` ranks for `model`'s stacked experts ([E, out, in], this rank's E
    under expert parallel): dim 0 (whole experts a rank) when the experts divide evenly over the ranks, else dim 1.
    FSDP2 pads dim 0 to a multiple of the ranks, so fewer experts than ranks (Mixtral's 8 over 16 ZeRO-3 ranks, or
    one expert a rank over 2 replicas) would leave each rank a whole expert's bytes, shard or padding: no saving.
    None (FSDP2's dim 0) for every other parameter and for QLoRA's 4-bit weights (sharded by rows)."""
    stacked = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters(recurse=False)}

    def place(p: nn.Parameter) -> Shard | None:
        local = p.to_local() if isinstance(p, DTensor) else p
        if id(p) in stacked and local.dim() == 3 and local.shape[0] % ranks and not nf4.is_nf4(local):
            return Shard(1)
        return None

    return place


def shard_experts_over_replicas(model: nn.Module, ctx: ParallelContext, policies: dict[str, Any]) -> None:
    """ZeRO-2/3 under expert parallel with edp > 1: each split GroupedExperts an FSDP2 unit over "edp" (module
    docstring), with the dense units' `policies` (mixed precision, reshard after forward). Before the blocks'
    units, which then leave the experts' parameters to it."""
    edp = ctx.submesh("edp")  # (not beside context parallel: fitlm.rules)
    assert edp is not None  # (edp > 1: a distributed run's mesh)
    # The grouped path returns its output through an identity autograd function (a view: fitlm.models.moe's
    # _ContiguousGrad), which FSDP2 warns about in case the caller modifies it in place; the dispatch only indexes it.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGroupedExperts\) returned a view")
    place = expert_shard_placement(model, edp.size())
    for layer in moe_layers([model]):
        if getattr(layer.experts, _EXPERT, False):
            fully_shard(layer.experts, mesh=edp, **policies, shard_placement_fn=place)
            setattr(layer.experts, _SHARDED, True)


def sync_expert_gradients(modules: list[nn.Module], ctx: ParallelContext) -> None:
    """Sum expert gradients over the ranks holding the same experts ("edp", with the context-parallel ranks
    "edp_cp") and divide by dp x cp, the divisor of every other gradient (module docstring); those FSDP2
    reduce-scattered over those ranks (an average) are scaled by edp / dp."""
    dim = ctx.dims.expert_replica_dim
    group = ctx.group(dim) if ctx.dims.expert_replicas > 1 else None
    whole = {id(p) for p in expert_parameters(modules, whole_only=True)}
    for p in expert_parameters(modules):
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if id(p) not in whole:
            local.mul_(ctx.dims.edp / ctx.dims.dp)
            continue
        if group is not None:
            with collective("all-reduce", "an expert gradient", dim, local):
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        local.div_(ctx.dims.dp_cp)
