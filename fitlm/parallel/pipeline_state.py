"""What crosses pipeline stages outside the schedule: tied-embedding gradients, the global gradient
norm and the unsplit state dict (see fitlm.parallel.pipeline for the stages themselves).

Tied embeddings (`model.tie_embeddings`) across pp ranks: the first stage keeps `embed_tokens.weight`,
the last stage a copy as `lm_head.weight`. `sync_tied_grads` adds the two gradients together (what a
single shared Parameter would get); both copies start equal and receive equal updates, provided the
optimizer treats them alike (`fitlm.step.optim.param_groups`). The copy is counted once in `clip_grad_norm_pp`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fitlm.parallel.collective_trace import collective
from fitlm.parallel.grad_norm import clip_by_norm, clip_each, squared_norm

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM

TIED_COPY = "_fitlm_pp_tied_copy"  # attribute set on the last stage's copy of a tied embedding


def as_process_group(pp_group) -> dist.ProcessGroup:
    """The ProcessGroup of a 1-D DeviceMesh (e.g. mesh["pp"]), or `pp_group` itself when it is one."""
    return pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group


def tag_tied_copies(stage_modules: list[tuple[int, nn.Module]]) -> None:
    """Mark a last stage's head that copies a tied embedding (held by the first stage).

    build_stage_modules does this; call it again after anything that replaces Parameters
    (FSDP2's fully_shard does), or clip_grad_norm_pp will count that copy twice.
    """
    for _, mod in stage_modules:
        mod = cast("CausalLM", mod)  # (a stage: a family's model, parts of it None)
        if getattr(mod.config, "tie_embeddings", False) and mod.lm_head is not None and mod.model.embed_tokens is None:
            setattr(mod.lm_head.weight, TIED_COPY, True)


# --------------------------------------------------------------------------- optimizer helpers


def sync_tied_grads(stage_modules: list[tuple[int, nn.Module]], pp_group) -> None:
    """With tied embeddings split across pp ranks, give both copies the sum of their gradients.

    Call after the step's backward passes, before clipping. Only pp ranks 0 and pp-1 communicate
    (point to point); other ranks return at once. A no-op without tying.
    """
    group = as_process_group(pp_group)
    pp_size = dist.get_world_size(group)
    for sid, mod in stage_modules:
        mod = cast("CausalLM", mod)  # (a stage: a family's model, parts of it None)
        if pp_size == 1 or not getattr(mod.config, "tie_embeddings", False):
            return
        if sid == 0 and mod.model.embed_tokens is not None:
            param, peer, name = mod.model.embed_tokens.weight, pp_size - 1, "model.embed_tokens.weight"
        elif mod.lm_head is not None and mod.model.embed_tokens is None:
            param, peer, name = mod.lm_head.weight, 0, "lm_head.weight (the tied copy)"
        else:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != cast(DTensor, param).placements:  # (so is param)
            # Under tensor parallel the vocab-parallel embedding's gradient can come back Replicate (a full
            # [V, C]) where the head's copy is Shard(0): the two ends must exchange the same shard.
            param.grad = grad = grad.redistribute(placements=cast(DTensor, param).placements)
        mine = grad._local_tensor if isinstance(grad, DTensor) else grad  # dp/tp shards now match
        theirs = torch.empty_like(mine)
        ops = [
            dist.P2POp(dist.isend, mine.contiguous(), group=group, group_peer=peer),
            dist.P2POp(dist.irecv, theirs, group=group, group_peer=peer),
        ]
        with collective("send/recv", f"the tied embedding gradient {name}", "pp", mine, f"pp rank {peer}"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        mine.add_(theirs)


def clip_grad_norm_pp(parameters: Iterable[torch.Tensor], max_norm: float, pp_group) -> torch.Tensor:
    """Clip by the gradient norm over all pipeline stages; returns that (pre-clip) norm on every rank.

    Sum of squares per rank, all-reduced over the pp group. A tied head copy (see sync_tied_grads) is
    clipped but not counted: the unsplit model holds that Parameter once.
    """
    group = as_process_group(pp_group)
    params = [p for p in parameters if p.grad is not None]
    counted = [cast(torch.Tensor, p.grad) for p in params if not getattr(p, TIED_COPY, False)]  # (all have one)
    sq = squared_norm(counted)
    # A rank without gradients (a frozen stage) still joins the all-reduce, on the backend's device.
    device = (
        cast(torch.Tensor, params[0].grad).device
        if params
        else (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else sq.device)
    )
    sq = sq.to(device)
    with collective("all-reduce", "the squared gradient norm", "pp", sq):
        dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    # Expert-parallel experts (DTensors on "ep") beside plain or FSDP2 gradients: torch's foreach clip cannot take
    # them in one list, so each is scaled on its own (the same factor).
    kinds = {g.device_mesh if isinstance(g, DTensor) else None for g in (p.grad for p in params)}
    (clip_each if len(kinds) > 1 else clip_by_norm)(params, max_norm, total)
    return total


# --------------------------------------------------------------------------- state dict


@torch.no_grad()
def gather_full_state_dict(
    stage_modules: list[tuple[int, nn.Module]], pp_group, gather: bool = True
) -> dict[str, torch.Tensor] | None:
    """The unsplit model's state_dict (same keys, same order, CPU tensors) on pp rank 0; None elsewhere.

    DTensor entries (tp/FSDP) are materialised with full_tensor(), a collective over their mesh, so
    every rank of the stage must call this.
    `gather=False` materialises only (for replicas whose pp group need not gather). Goes through
    gather_object: fine for a final export; use torch.distributed.checkpoint for resumable checkpoints.
    """
    group = as_process_group(pp_group)
    local = [
        (
            sid,
            {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in mod.state_dict().items()},
        )
        for sid, mod in stage_modules
    ]
    if not gather:
        return None
    gathered: list | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(local, gathered, group=group, group_dst=0)
    if gathered is None:
        return None
    # Stage order = module order of the unsplit model (embeddings, layers 0..L-1, norm, head).
    parts = sorted((pair for rank_parts in gathered for pair in rank_parts), key=lambda p: p[0])
    full: dict[str, torch.Tensor] = {}
    for _, sd in parts:
        full.update(sd)
    return full
