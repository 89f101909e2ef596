"""Data parallel and ZeRO stages 0-3 applied to an unmodified model (see fitlm.parallel_dims.ZERO_STAGES).

Every engine here *averages* gradients over the data-parallel ranks, so the trainer scales each
rank's loss by the data-parallel degree to get the gradient of the global token-weighted mean.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # FSDPModule.set_custom_all_gather's interface
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fitlm.config import MemoryConfig
from fitlm.hardware import return_freed_host_memory
from fitlm.memory.offload import fsdp_offload_policy
from fitlm.memory.precision import cast_left_out, fsdp_mixed_precision
from fitlm.memory.recompute import transformer_blocks
from fitlm.parallel.collective_trace import collective
from fitlm.parallel.expert_parallel import (
    expert_parameters,
    expert_shard_placement,
    shard_experts_over_replicas,
    sync_expert_gradients,
)
from fitlm.parallel.expert_tensor_parallel import sync_split_expert_gradients
from fitlm.parallel.mesh import ParallelContext
from fitlm.parallel.streamed_vocab import apply_streamed_tables, streamed_tables

_MANUAL_SYNC = "_fitlm_dp_all_reduce"  # set on modules whose gradients the trainer all-reduces itself


def apply_data_parallel(model: nn.Module, ctx: ParallelContext, memory: MemoryConfig | None = None) -> nn.Module:
    """Wrap for data parallel over the mesh's "dp" dimension ("dp_cp" under context parallel, whose ranks hold the
    same parameters and each compute the gradient of their part of every sequence). Apply after tensor parallel
    and recompute.

    ZeRO 2/3 shard each block, then the root (embeddings, final norm, head), with FSDP2. ZeRO 0/1 use
    DDP where it applies (no tensor or pipeline parallel); beside those, whose parameters DDP cannot
    take, gradients are all-reduced by `sync_gradients` after backward instead. `memory` gives FSDP2
    its mixed-precision policy (O2: half all-gather, fp32 reduce) and CPU offload policy. Over gloo
    the units gather in place (`InPlaceAllGather`), and a frozen embedding is not gathered in backward. Frozen,
    untied embeddings and heads are not gathered at all (`fitlm.parallel.streamed_vocab`).
    """
    if ctx.dims.dp_cp == 1:
        return model
    dp_mesh = ctx.submesh(ctx.dims.token_dim)
    if ctx.dims.fsdp_sharded:
        memory = memory or MemoryConfig()
        policies = dict(
            mesh=dp_mesh,
            mp_policy=fsdp_mixed_precision(memory),
            offload_policy=fsdp_offload_policy(memory.cpu_offload, ctx.device),
            # ZeRO-3 frees gathered parameters after forward; ZeRO-2 keeps them for backward.
            reshard_after_forward=ctx.dims.zero_stage == 3,
        )
        assert dp_mesh is not None  # (dp_cp > 1: a distributed run's mesh)
        place = expert_shard_placement(model, dp_mesh.size())  # fewer stacked experts than ranks: another dim
        # Frozen vocabulary tables stay out of FSDP2, their rows streamed piece by piece
        # (fitlm.parallel.streamed_vocab).
        tables = (
            [] if ctx.tp > 1 or ctx.pp > 1 or memory.cpu_offload else streamed_tables(model, memory.loss_chunk_size)
        )
        # Expert-parallel experts (DTensors on "ep"): sharded by FSDP2 over the replicas of the same experts
        # ("edp") where there are some, else left out of FSDP2 and summed over their replicas
        # (fitlm.parallel.expert_parallel.sync_expert_gradients).
        if ctx.ep > 1 and ctx.dims.edp > 1:
            shard_experts_over_replicas(model, ctx, {k: v for k, v in policies.items() if k != "mesh"})
        experts = set(expert_parameters([model], whole_only=True))
        cast_left_out([m for m in model.modules() if any(p in experts for p in m.parameters(recurse=False))], memory)
        ignored = (apply_streamed_tables(tables, dp_mesh) or set()) | experts or None
        host = dist.get_backend(dp_mesh.get_group()) == "gloo"
        for block in transformer_blocks(model):
            if host and not memory.compile:
                # Over gloo the gathered units are host memory, and FSDP2 holds a unit up to three times at once
                # in backward (the one computing, the prefetched one's all-gather buffer and its copy-out): each
                # Linear (with its adapters) gathers on its own, so that is three Linears, not three blocks
                # (the step's peak per rank falls accordingly; bench/RESULTS.md, "fp32 LoRA under the bar").
                for linear in _block_linears(block):
                    fully_shard(linear, **policies)
            fully_shard(
                block, **policies, ignored_params=experts & set(block.parameters()) or None, shard_placement_fn=place
            )
        for unit in _own_units(model, memory, streamed=tables):
            fully_shard(unit, **policies)
            if isinstance(unit, nn.Embedding) and not unit.weight.requires_grad:
                # Nothing flows back through a frozen lookup table, yet FSDP2's backward prefetch would
                # gather it (vocab x hidden) beside block 0 and hold it to the end of backward.
                cast(FSDPModule, unit).set_unshard_in_backward(False)  # (fully_shard made it one)
        fully_shard(model, **policies, ignored_params=ignored)
        if host:
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_custom_all_gather(InPlaceAllGather())
        return model
    if ctx.dims.ddp:
        # Gradients as views into DDP's communication buckets: no second, flat copy of every gradient
        # (4 bytes per fp32 parameter at the optimizer step's peak).
        return DistributedDataParallel(model, process_group=ctx.group(ctx.dims.token_dim), gradient_as_bucket_view=True)
    setattr(model, _MANUAL_SYNC, True)
    return model


def _block_linears(block: nn.Module) -> list[nn.Module]:
    """A block's Linears; a Linear inside another (LoRA's lora_A/lora_B) goes with the one that holds it."""
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    inner = {id(c) for m in linears for c in m.modules() if c is not m}
    return [m for m in linears if id(m) not in inner]


def _own_units(model: nn.Module, memory: MemoryConfig, streamed: list[nn.Module]) -> list[nn.Module]:
    """The embedding and the output head as FSDP units of their own, gathered one at a time rather than
    together with the root: each is vocab x hidden, usually the model's two largest tensors (2 x 262 MB
    fp32 on a 32k-vocab, 2048-wide model), and a gather briefly holds its output buffer and the copied-out
    parameters. Not when they are tied (one parameter cannot be in two units), nor the head under chunked
    loss, which reads its weight inside the root's forward instead of calling the module, nor `streamed` tables."""
    body = getattr(model, "model", None)
    embed, head = getattr(body, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and embed.weight is head.weight:
        return []
    units = [embed] if embed is not None else []
    if head is not None and not memory.loss_chunk_size:
        units.append(head)
    return [u for u in units if all(u is not t for t in streamed)]


def gather_chunks_in_place(out: torch.Tensor, group: dist.ProcessGroup, last_async: bool = False) -> dist.Work | None:
    """All-gather along dim 0 into `out`, whose `out.chunk(world)[rank]` already holds this rank's part:
    one in-place broadcast per rank. Why not all_gather_into_tensor: gloo's gathers receive into a flat
    buffer of their own and copy it out, so a gather holds twice its output (a 262 MB fp32 head: 524 MB),
    and on a CPU device that is host memory. The bytes sent are the same as a ring all-gather's.
    `last_async`: the last broadcast is left running and its work returned (the earlier ones have finished)."""
    sends = [
        (i, chunk) for i, chunk in enumerate(out.chunk(dist.get_world_size(group))) if chunk.numel()
    ]  # torch.chunk leaves trailing ranks empty on short dims; every rank skips alike
    work = None
    for n, (i, chunk) in enumerate(sends):
        work = dist.broadcast(chunk, group_src=i, group=group, async_op=last_async and n == len(sends) - 1)
    return work


class InPlaceAllGather(AllGather):
    """FSDP2's all-gather as `gather_chunks_in_place` (FSDP2 copies each rank's shard into its slot of the
    output before calling it). It always hands FSDP2 a work to wait on: given none, FSDP2 (torch 2.13) keeps
    each unit's gathered buffer in forward until the next unit has gathered and copied out, so the head's
    gather would also hold the last block's buffer."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if torch.device(device).type == "cpu":
            # The units gathered before were freed into the heap (their weights are below glibc's mmap
            # threshold once it has risen to 32 MiB), where they stay resident, fragmented by the activations
            # between them, and would raise the step's peak (bench/RESULTS.md, "fp32 LoRA under the bar").
            return_freed_host_memory()
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        return gather_chunks_in_place(output_tensor, group, last_async=True)


def plain_module(module: nn.Module) -> nn.Module:
    """The fitlm model inside the wrappers a layout puts around it (DDP's `.module`, torch.compile's `_orig_mod`)."""
    while True:
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def sync_gradients(modules: list[nn.Module], ctx: ParallelContext) -> None:
    """Average gradients over "dp" (or "dp_cp") for modules that no engine syncs (tensor/pipeline/expert parallel
    with ZeRO 0); expert-parallel experts are summed over their own replicas (whatever the ZeRO stage)."""
    if ctx.tp > 1:
        sync_split_expert_gradients(modules)
    if ctx.ep > 1:
        sync_expert_gradients(modules, ctx)
    group = ctx.group(ctx.dims.token_dim)
    experts = set(expert_parameters(modules))
    for module in modules:
        if not getattr(module, _MANUAL_SYNC, False):
            continue
        for name, p in module.named_parameters():
            if p.grad is None or p in experts:
                continue
            # A DTensor gradient (tensor parallel) is averaged shard by shard: dp replicas hold equal shards.
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            with collective("all-reduce", f"the gradient of {name}", ctx.dims.token_dim, local):
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
            local.div_(ctx.dims.dp_cp)


def set_gradient_sync(modules: list[nn.Module], enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last accumulation micro batch."""
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled)
        elif isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = enabled


@contextmanager
def whole_root(module: nn.Module) -> Iterator[None]:
    """The root's own parameters (embedding, final norm, head) gathered under ZeRO-2/3 for code that calls the
    model's parts instead of its forward (the decoder's `hidden_states` and `logits`: the root's forward hook,
    which gathers them, never runs); each block still gathers in its own forward. Nothing for other layouts."""
    if not isinstance(module, FSDPModule):
        yield
        return
    # FSDP2 sets every unit up at the root's first forward; a part called first would take itself for the root
    module._get_fsdp_state()._lazy_init()
    module.unshard()
    try:
        yield
    finally:
        module.reshard()
