"""A parallelized model's full weights, one block at a time, on global rank 0.

Why: gathering the whole state dict on rank 0 for the final save puts the whole model in one
process's memory, the very thing sharding avoided. Here every rank walks its parameters block by
block (`fitlm.models.streaming.layer_group`): the shards of one block are gathered (`full_tensor`,
a collective over the ranks that hold them), handed to rank 0 -- sent by the other pipeline stages --
and dropped before the next block. The consumer on rank 0 (`fitlm.models.io.write_model_dir`)
writes each block as it arrives, so a rank's peak is its shard plus one block.

Every rank must drain `full_groups` to the end, rank 0 included: the walk is a sequence of
collectives, and a rank that stops early leaves the others waiting.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fitlm.hardware import return_freed_host_memory
from fitlm.memory.nf4 import dequantized
from fitlm.models.experts import PROJECTIONS, GroupedExperts
from fitlm.models.streaming import grouped
from fitlm.parallel.apply import ParallelModel
from fitlm.parallel.data_parallel import gather_chunks_in_place, unwrap
from fitlm.parallel.materialize import plain_name

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def _local_modules(pm: ParallelModel) -> list[nn.Module]:
    if pm.pipeline is not None:
        return [m for _, m in pm.pipeline._bare()]
    return [unwrap(pm.model)]


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Plain names -> tensors (DTensors stay sharded), the tied head once under each name it has."""
    return {plain_name(k): v for k, v in module.state_dict().items()}


def _stacked_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Plain names -> [E, out, in] of the stacked expert weights stored in another shape (QLoRA's NF4 codes,
    [E·out, in]): what the checkpoint holds, and what they are gathered back to."""
    return {
        plain_name(f"{name}.{p}"): m.stacked_shape(p)
        for name, m in module.named_modules()
        if isinstance(m, GroupedExperts)
        for p in PROJECTIONS
        if getattr(m, p).dim() != 3
    }


def weight_specs(pm: ParallelModel) -> Specs:
    """Every weight of the whole model, plain name -> (dtype, global shape). Collective under pipeline
    parallel (each stage knows its own blocks only)."""
    mine = {}
    for m in _local_modules(pm):
        stacked = _stacked_shapes(m)
        mine.update({k: (v.dtype, stacked.get(k, tuple(v.shape))) for k, v in _state(m).items()})
    if pm.pipeline is None:
        return mine
    everyone: list = [None] * dist.get_world_size(pm.pipeline.group)
    dist.all_gather_object(everyone, mine, group=pm.pipeline.group)
    return {k: v for stage in everyone for k, v in stage.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    t = dequantized(t)  # QLoRA's NF4 base: each rank's rows back to weights before the gather
    if not isinstance(t, DTensor):
        return t.detach().cpu()
    group = t.device_mesh.get_group(0) if t.device_mesh.ndim == 1 else None
    if group is not None and t.placements == (Shard(0),) and dist.get_backend(group) == "gloo":
        # ZeRO-3's shards over gloo: gathered in place (gloo's own all-gather holds the output twice).
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        # fewer chunks than ranks on a short dim 0 (a router's E rows, Qwen2-MoE's [1, H] shared_expert_gate):
        chunks = out.chunk(dist.get_world_size(group))
        if dist.get_rank(group) < len(chunks):  # the trailing ranks' shards are empty
            chunks[dist.get_rank(group)].copy_(t.to_local())
        gather_chunks_in_place(out, group)
        return out.cpu()
    return t.full_tensor().detach().cpu()


def handed_over(groups: Iterator[dict | None]) -> Iterator[dict | None]:
    """`groups`, each dict emptied once the consumer asks for the next: a generator loop's variable keeps the
    previous block alive while the next one is gathered, so without this a chain of consumers (the LoRA
    merge, the HF renaming, the writer) holds two or three blocks at a time instead of one."""
    for group in groups:
        yield group
        if group is not None:
            group.clear()


def _blocks(pm: ParallelModel) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's blocks, gathered over the ranks that shard them (every rank of a stage calls the same)."""
    for module in _local_modules(pm):
        state, stacked = _state(module), _stacked_shapes(module)
        for names in grouped(state).values():
            return_freed_host_memory()  # the groups before, freed into the heap: not resident while this one gathers
            yield {n: _full(state[n]).reshape(stacked[n]) if n in stacked else _full(state[n]) for n in names}


def full_groups(pm: ParallelModel) -> Iterator[dict[str, torch.Tensor] | None]:
    """One block's full weights at a time on global rank 0; None on the other ranks. Collective: drain it
    on every rank. A block is valid until the next is asked for (`handed_over`)."""
    return handed_over(_full_groups(pm))


def _full_groups(pm: ParallelModel) -> Iterator[dict[str, torch.Tensor] | None]:
    ctx = pm.ctx
    if pm.pipeline is None:
        for block in _blocks(pm):
            yield block if ctx.is_main else None
        return
    # Pipeline: the first data/tensor-parallel replica of each stage sends its blocks to pp rank 0 in turn.
    group, first = pm.pipeline.group, ctx.dp_rank == 0 and ctx.tp_rank == 0
    for stage in range(ctx.pp):
        if ctx.pp_rank == stage:
            for block in _blocks(pm):
                if first and stage == 0:
                    yield block if ctx.is_main else None
                elif first:
                    dist.send_object_list([block], group_dst=0, group=group)
            if first and stage != 0:
                dist.send_object_list([None], group_dst=0, group=group)  # this stage is done
        elif ctx.pp_rank == 0 and first:
            while True:
                box: list = [None]
                dist.recv_object_list(box, group_src=stage, group=group)
                if box[0] is None:
                    break
                yield box[0] if ctx.is_main else None
