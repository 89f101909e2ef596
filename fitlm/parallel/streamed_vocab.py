"""Frozen vocabulary tables under ZeRO-2/3 that stay sharded: their rows reach the lookup or matmul piece by piece.

Why: FSDP2 gathers a unit whole and then copies it out of the all-gather buffer, so gathering a vocab x hidden
table (262 MB in fp32 at 32k x 2048; 1 GiB in bf16 at Llama 3's 128k x 4096) holds twice its size: the head at
the end of forward, where the activations peak, and again at the start of backward; the embedding at the start
of forward. A frozen table has no gradient to reduce-scatter, so nothing needs FSDP2 to own it. Here each rank
keeps its rows as a DTensor `Shard(0)` over the data-parallel mesh (the placement FSDP2 gives it, so loading,
checkpoints and the final save are unchanged), and the rows travel from their owner one piece at a time (one
broadcast per piece: the bytes of FSDP2's all-gather). The head computes each piece's columns of the logits (in
backward, the same pieces give the input's gradient); the embedding copies out the rows its tokens name. A rank
holds one piece (<= `PIECE_BYTES`) beside its rows.

Used for an untied, frozen head called as a module (full logits: the chunked loss reads the weight itself and
keeps the head in FSDP2's root unit, gathered once per step) and an untied, frozen embedding, when neither
tensor nor pipeline parallel nor CPU offload applies.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fitlm.models.layers import attention_dtype

PIECE_BYTES = 32 * 2**20  # a piece of head rows in flight: small beside the head, large enough for full GEMMs


def streamed_tables(model: nn.Module, loss_chunk_size: int) -> list[nn.Module]:
    """The embedding and head `apply_streamed_tables` takes over: frozen and untied ones (a tied table is one
    parameter in both places; a trained one needs FSDP2's reduce-scatter), the head only when called as a module."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and embed.weight is head.weight:
        return []
    out: list[nn.Module] = []
    if type(embed) is nn.Embedding and not embed.weight.requires_grad and embed.max_norm is None:
        out.append(embed)
    if type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad and not loss_chunk_size:
        out.append(head)
    return out


def apply_streamed_tables(tables: list[nn.Module], mesh: DeviceMesh) -> set[nn.Parameter]:
    """Make each table's weight (meta or real) this rank's rows of a `Shard(0)` DTensor over the 1-D `mesh`, and
    its forward the streamed lookup (nn.Embedding) or projection (nn.Linear). Returns the new parameters, for
    FSDP2's `ignored_params`."""
    return {_streamed(t, mesh) for t in tables}


def _streamed(table: nn.Module, mesh: DeviceMesh) -> nn.Parameter:
    w = cast(torch.Tensor, table.weight)  # (an Embedding's or a Linear's)
    rows = _row_ranges(w.shape[0], mesh.size())
    start, stop = rows[mesh.get_local_rank()]
    local = (
        w.detach()[start:stop].clone()
        if w.device.type != "meta"
        else torch.empty(stop - start, w.shape[1], dtype=w.dtype, device=w.device)
    )
    param = nn.Parameter(
        DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride()),
        requires_grad=False,
    )
    table.weight = param
    group = mesh.get_group()
    # (a per-instance forward, which mypy refuses on nn.Embedding's own method; the weight is the DTensor just set)
    if isinstance(table, nn.Embedding):
        table.forward = lambda ids: _lookup(  # type: ignore[method-assign, assignment]
            ids, cast(DTensor, table.weight)._local_tensor, rows, group
        )
    else:
        table.forward = lambda h: _StreamedProjection.apply(h, cast(DTensor, table.weight)._local_tensor, rows, group)
    return param


def _row_ranges(n: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, stop) rows under torch.chunk's split (DTensor's and FSDP2's Shard(0))."""
    size = -(-n // world)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


def _pieces(rows: list[tuple[int, int]], width: int, itemsize: int) -> list[tuple[int, int, int]]:
    """(owner, start, stop) row pieces of the whole weight, each at most PIECE_BYTES, in row order."""
    step = max(1, PIECE_BYTES // max(1, width * itemsize))
    return [
        (owner, a, min(a + step, stop)) for owner, (start, stop) in enumerate(rows) for a in range(start, stop, step)
    ]


def _stream(local: torch.Tensor, rows: list[tuple[int, int]], group: dist.ProcessGroup):
    """Yield (start, stop, weight rows [stop-start, C]) for every piece, broadcast from its owner to the group."""
    me = dist.get_rank(group)
    pieces = _pieces(rows, local.shape[1], local.element_size())
    size = max(b - a for _, a, b in pieces)
    buf = local.new_empty(size, local.shape[1]) if len(rows) > 1 else None  # [piece rows, C], reused
    for owner, a, b in pieces:
        if owner == me:
            w = local[a - rows[me][0] : b - rows[me][0]]  # a view of this rank's rows, contiguous
        else:
            assert buf is not None  # (another owner: more than one row range)
            w = buf[: b - a]
        dist.broadcast(w, group_src=owner, group=group)
        yield a, b, w


@torch.no_grad()
def _lookup(
    ids: torch.Tensor, local: torch.Tensor, rows: list[tuple[int, int]], group: dist.ProcessGroup
) -> torch.Tensor:
    """Embedding rows for token ids [...] -> [..., C] (frozen: no gradient), each piece's rows copied to its tokens."""
    vocab = rows[-1][1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):  # nn.Embedding's check: never leave rows unset
        raise IndexError(
            f"token id {int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())} is outside the "
            f"embedding's {vocab} rows; the tokenizer does not match the model's vocab_size"
        )
    # Static shapes (no boolean indexing), so the planner's fake-tensor simulation runs it too: each piece's rows
    # are gathered for every token (ids clamped into the piece) and added where the token falls in the piece;
    # every token falls in exactly one, onto zeros, so the sum is the row itself.
    out = local.new_zeros(*ids.shape, local.shape[1])  # [..., C]
    for a, b, w in _stream(local, rows, group):
        hit = ((ids >= a) & (ids < b)).unsqueeze(-1).to(out.dtype)  # [..., 1]
        out.addcmul_(w[(ids - a).clamp(0, b - a - 1)], hit)
    return out


class _StreamedProjection(torch.autograd.Function):
    """logits = h @ W.T with W's rows streamed: h [..., C], local [rows of this rank, C] -> [..., V]. W is frozen,
    so backward streams the rows again for the input's gradient and returns none for W. Runs in autocast's
    dtype when autocast is on (as F.linear would), autocast itself off inside."""

    @staticmethod
    def forward(ctx, h, local, rows, group):
        dtype = attention_dtype(h)
        ctx.rows, ctx.group, ctx.dtype, ctx.in_dtype = rows, group, dtype, h.dtype
        ctx.save_for_backward(local)
        x = h.to(dtype)
        out = x.new_empty(*h.shape[:-1], rows[-1][1])  # [..., V]
        with torch.autocast(h.device.type, enabled=False):
            for a, b, w in _stream(local, rows, group):
                out[..., a:b] = F.linear(x, w.to(dtype))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (local,) = ctx.saved_tensors
        g = grad_out.to(ctx.dtype)
        # The pieces' partial sums are added in fp32: in half precision each addition would round again.
        grad_h = g.new_zeros(*g.shape[:-1], local.shape[1], dtype=torch.float32)  # [..., C]
        with torch.autocast(g.device.type, enabled=False):
            for a, b, w in _stream(local, ctx.rows, ctx.group):
                grad_h += g[..., a:b] @ w.to(ctx.dtype)
        return grad_h.to(ctx.in_dtype), None, None, None
