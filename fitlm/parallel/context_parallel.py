"""Context parallel: each sequence is split over the "cp" ranks; every query still attends over all its keys.

Split: with C ranks a [B, T] row is cut into 2C equal chunks and rank r keeps chunks r and 2C-1-r (the
head-tail or "zigzag" balance of Megatron-LM and torchtitan). Under causal attention query i reads i+1
keys, so C contiguous pieces would give the last rank about 2C-1 times the first one's attention work;
every head-tail pair reads the same number of keys. Everything outside attention works per token and runs
on the rank's T/C tokens unchanged: embedding, norms, MLP, the loss over the rank's own labels.

Attention: each layer all-gathers the group's keys and values ([B,K,T/C,D] -> [B,K,T,D]; its backward is a
reduce-scatter of their gradients) and runs this rank's queries against all of them under a mask built
from global positions: causal, within one document (data.document_mask), within the sliding window. That
is exact for any mask -- the reason it is chosen over a ring, as Llama 3 did for document masks -- at the
cost of a full-length K/V per layer kept for backward and one [T/C, T] additive mask per micro batch (shared
by the layers), which the planner counts. RoPE rotates each token
by its global position (or its position in its document): the step passes those positions to the model.

`apply_context_parallel` points each attention layer's `attend` at `ContextParallel.attend`; the step
splits each micro batch with `ContextParallel.split` and runs forward and backward (recompute re-runs the
gathers) inside `ContextParallel.using(shard)`, which tells `attend` where this rank's tokens sit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fitlm.models.layers import SelfAttention, additive_mask, band_mask, document_position_ids, softcapped_attention


def zigzag_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions this rank holds, in its local order: chunks `rank` and 2C-1-`rank` of 2C. [T/C]"""
    if seq_len % (2 * cp):
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be cut into the {2 * cp} equal chunks context "
            f"parallel over {cp} ranks needs; data.seq_length must be a multiple of {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        ]
    )


@dataclass
class SequenceShard:
    """Where one micro batch's tokens sit: this rank's queries and the group's gathered keys."""

    index: torch.Tensor  # [T/C] global position of each local token (query)
    key_index: torch.Tensor  # [T] global position of each gathered key slot (ranks in order, each zigzag)
    document_ids: torch.Tensor | None  # [B, T] the whole rows' document ids, or None without document masks
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """bool [T/C, T] or [B, 1, T/C, T], True where a local query may attend a gathered key; built once per
        micro batch and window and shared by the layers. The diagonal is always allowed (no empty row)."""
        key = ("bool", window)
        if key not in self._masks:
            self._masks[key] = self._allowed(window)
        return self._masks[key]

    def _allowed(self, window: int | None) -> torch.Tensor:
        q, k = self.index[:, None], self.key_index[None, :]  # [T/C,1], [1,T]
        allowed = k <= q
        if window is not None:
            allowed = allowed & (k > q - window)
        if self.document_ids is not None:
            same = self.document_ids[:, self.index, None] == self.document_ids[:, None, self.key_index]  # [B,T/C,T]
            allowed = (allowed & same).unsqueeze(1)
        return allowed

    def additive_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """`mask` in SDPA's additive form and the attention's dtype, built once per micro batch, window and
        dtype and shared by every layer (SDPA would convert a boolean mask per layer and keep each copy:
        `fitlm.models.layers.additive_mask`)."""
        key = ("full", window, dtype)
        if key not in self._masks:
            self._masks[key] = additive_mask(self.mask(window), dtype)
        return self._masks[key]

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(first local row, global chunk index) of this rank's two chunks, in local order."""
        cp = self.key_index.numel() // self.index.numel()
        c = self.index.numel() // 2
        first = int(self.index[0]) // c
        return [(0, first), (c, 2 * cp - 1 - first)]

    @property
    def natural_order(self) -> torch.Tensor:
        """[T] the gathered key slot holding global position 0, 1, ... (the inverse of key_index)."""
        if "order" not in self._masks:
            self._masks["order"] = torch.argsort(self.key_index)
        return self._masks["order"]

    def prefix_mask(self, queries: int, keys: int, dtype: torch.dtype) -> torch.Tensor:
        """[queries, keys] additive causal mask of a chunk's queries, the last `queries` positions of `keys`
        (bottom-right aligned: query i sees keys 0..keys-queries+i); shared by the layers."""
        key = ("prefix", queries, keys, dtype)
        if key not in self._masks:
            self._masks[key] = additive_mask(band_mask(queries, keys, keys - queries, None, self.index.device), dtype)
        return self._masks[key]


class _GatherSequence(torch.autograd.Function):
    """All-gather [B,K,t,D] along the sequence over the group, rank-major: [B,K,C·t,D]. Backward: the
    gradients every rank computed for each rank's keys are summed onto their owner (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        b, k, t, d = x.shape
        out = torch.empty((cp * b, k, t, d), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)  # [C·B,K,t,D]
        return out.view(cp, b, k, t, d).permute(1, 2, 0, 3, 4).reshape(b, k, cp * t, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, k, s, d = grad.shape
        t = s // ctx.cp
        parts = grad.reshape(b, k, ctx.cp, t, d).permute(2, 0, 1, 3, 4).reshape(ctx.cp * b, k, t, d).contiguous()
        out = torch.empty((b, k, t, d), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, parts, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


class ContextParallel:
    """The "cp" group of this rank and the micro batch being run."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self._shard: SequenceShard | None = None

    def split(self, batch: dict[str, torch.Tensor], document_mask: bool, device: torch.device):
        """(input_ids, labels, model kwargs, shard) of this rank's part of a micro batch [B, T]: the local
        tokens [B, T/C], their labels, their global RoPE positions (per document under document masks)."""
        ids = batch["input_ids"]
        t = ids.shape[1]
        index = zigzag_index(t, self.cp, self.rank)
        key_index = torch.cat([zigzag_index(t, self.cp, r) for r in range(self.cp)])
        doc = batch["document_ids"].to(device) if document_mask else None
        if doc is not None:
            positions = batch["position_ids"].to(device) if "position_ids" in batch else document_position_ids(doc)
        else:
            positions = torch.arange(t, device=device).expand(ids.shape[0], t)
        index, key_index = index.to(device), key_index.to(device)
        shard = SequenceShard(index, key_index, doc)
        local = {"position_ids": positions[:, index]}  # [B, T/C]; no document_ids: the mask is the shard's
        return ids.to(device)[:, index], batch["labels"].to(device)[:, index], local, shard

    @contextlib.contextmanager
    def using(self, shard: SequenceShard) -> Iterator[None]:
        """Run forward and backward of one split micro batch (recompute gathers again in backward)."""
        previous, self._shard = self._shard, shard
        try:
            yield
        finally:
            self._shard = previous

    @torch.compiler.disable  # collectives and a per-batch mask: a graph break for torch.compile
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_start: int = 0,
        attn_mask: torch.Tensor | None = None,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """`fitlm.models.layers.causal_attention`'s contract for this rank's queries q [B,H,t,D] and keys and
        values k, v [B,K,t,D]: gathered to [B,K,T,D], masked by global position. Returns [B,H,t,D]."""
        shard = self._shard
        if shard is None:
            raise RuntimeError(
                "context-parallel attention ran outside a split micro batch: run the model "
                "inside ContextParallel.using(shard), with the inputs ContextParallel.split gave"
            )
        if q_start or attn_mask is not None:
            raise RuntimeError(
                "context-parallel attention got a KV cache offset or a mask of its own: it is for "
                "training and scoring split batches; generate with an unsplit model"
            )
        k = _GatherSequence.apply(k, self.group, self.cp)  # [B,K,T,D]
        v = _GatherSequence.apply(v, self.group, self.cp)
        if shard.document_ids is None and window is None and softcap is None:
            return self._causal_by_chunk(q, k, v, shard, scale)
        if softcap is not None:
            return softcapped_attention(q, k, v, shard.mask(window), scale, softcap)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=shard.additive_mask(window, q.dtype), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    @staticmethod
    def _causal_by_chunk(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, scale: float | None
    ) -> torch.Tensor:
        """Plain causal attention chunk by chunk: each of the rank's two chunks (global index g, c queries)
        attends only the keys before its end, positions 0..(g+1)c-1, under a [c, (g+1)c] bottom-right causal
        mask. Against one [T/C, T] mask over all gathered keys this computes and masks about half the scores
        (the ones causality would discard), and the masks, shared by the layers, are about half the size.
        q [B,H,T/C,D]; k, v [B,K,T,D] gathered. Returns [B,H,T/C,D]."""
        order = shard.natural_order
        k, v = k.index_select(2, order), v.index_select(2, order)  # [B,K,T,D], global positions in order
        c = q.shape[2] // 2
        gqa = q.shape[1] != k.shape[1]
        outs = []
        for row, g in shard.chunks:
            end = (g + 1) * c
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, row : row + c],
                    k[:, :, :end],
                    v[:, :, :end],
                    attn_mask=shard.prefix_mask(c, end, q.dtype),
                    scale=scale,
                    enable_gqa=gqa,
                )
            )  # [B,H,c,D]
        return torch.cat(outs, dim=2)


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Every attention layer of `model` attends through `cp` (in place; parameters untouched)."""
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    if not layers:
        raise ValueError(
            f"context parallel found no attention layer (fitlm.models.layers.SelfAttention) in "
            f"{type(model).__name__}; this model cannot be split over the sequence"
        )
    for layer in layers:
        layer.attend = cp.attend
    return model
