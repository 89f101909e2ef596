"""Attention as blocked batched matmuls on CPU (memory.attention_backward: matmul / matmul_saved, applied by
fitlm.memory.attention_backward).

`matmul` (FlashMatmulAttention): the forward is SDPA's CPU flash kernel itself (the same output, bit for bit, and
its row log-sum-exp). The backward recomputes the probabilities from that log-sum-exp and differentiates with five
batched GEMMs instead of the flash kernel's own backward, which on CPU is the slow part of attention in half
precision. It holds [B, H, t, S] scores for one block of t query rows, so at long rows the flash kernel (which never
holds them) is faster again, and in fp32 it gains nothing.

`matmul_saved` (SavedMatmulAttention): the forward too is blocked GEMMs with fp32 scores and softmax, and it keeps
each block's fp32 probabilities for backward, which then recomputes nothing: 4 bytes per attended score per layer,
for attention faster than SDPA's at short rows in bf16 and fp32, its lead shrinking as rows grow. In a whole
training step the kept probabilities also push the step's other GEMMs out of cache, so the step gains less than
attention does (bench/train_throughput.py). Both are opt-in, for short-row training on CPU; bench/RESULTS.md
("Figures behind the code's design choices") has the timings against SDPA.

Queries go through in blocks of BLOCK_ROWS rows: a block attends only keys up to its last row (the causal
rule; fitlm's document and sliding-window masks only ever narrow it), so masked-out score blocks are never
computed, and the scores worked on at once are one block's: [B, H, 128, S] fp32 probabilities and their gradient,
with half copies of both.

Grouped-query attention: a block's query heads are folded onto their key/value head ([B,K,g·t,D]), so one
GEMM per product serves the group and dK, dV come out summed over it, with no expanded copies of k and v.

Shapes: B batch, H query heads, K key/value heads (g = H/K), T query rows = S keys, D head dim.
"""

from __future__ import annotations

import torch

from fitlm.models.layers import additive_mask, band_mask, causal_attention, restrict_mask

# Query rows per block. Of one block of all rows, 128 and 64, 128 was the fastest forward + backward (or within 2%
# of it) at every shape timed (bench/RESULTS.md, "Figures behind the code's design choices").
BLOCK_ROWS = 128


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B,H,t,D] -> [B,K,g·t,D]: each key/value head's query heads stacked along the rows."""
    b, h, t, d = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * t, d)


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B,K,g·t,D] -> [B,H,t,D]."""
    b, k, gt, d = x.shape
    return x.reshape(b, heads, gt * k // heads, d)


def _block_scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, r0: int, r1: int, scale: float
) -> torch.Tensor:
    """fp32 masked scores of query rows r0..r1-1 against keys 0..r1-1: [B,K,g,t,s] (t = r1-r0, s = r1).

    In fp32: rounded to half, exp() would carry their rounding (~0.4% of a score of 5) into every probability and
    gradient; so computed, forward and gradients are as close to fp64 as SDPA's own (tested)."""
    kv_heads, g = k.shape[1], q.shape[1] // k.shape[1]
    qb = _fold(q[:, :, r0:r1], kv_heads)  # [B,K,g·t,D]
    # Scaled out of place: selective recompute (fitlm.memory.recompute) keeps the matmul's output from the first
    # forward and hands that very tensor back when it reruns the forward, so it must come back unchanged.
    scores = (qb.float() @ k[:, :, :r1].float().transpose(-1, -2)).mul(scale).view(*qb.shape[:2], g, r1 - r0, r1)
    if mask is None:
        rows = torch.arange(r0, r1, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(r1, device=q.device)[None, :] > rows, float("-inf"))  # later keys
    else:
        scores.add_(mask[:, :, r0:r1, :r1].unsqueeze(2))  # [B|1,1,1,t,s], 0 / -inf
    return scores


def _block_backward(
    probs: torch.Tensor,
    q,
    k,
    v,
    grad_out,
    r0: int,
    r1: int,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add one query block's gradients: `probs` fp32 [B,K,g·t,s] (the block's probabilities, only read);
    dq [B,H,T,D] is written for rows r0..r1-1, the fp32 dk, dv [B,K,T,D] accumulate over keys 0..r1-1."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qb, gob = _fold(q[:, :, r0:r1], kv_heads), _fold(grad_out[:, :, r0:r1], kv_heads)  # [B,K,g·t,D]
    kb, vb = k[:, :, :r1], v[:, :, :r1]  # [B,K,s,D]
    dv[:, :, :r1] += (probs.to(q.dtype).transpose(-1, -2) @ gob).float()
    dprobs = (gob @ vb.transpose(-1, -2)).float()  # [B,K,g·t,s]
    # The row term sum_j P·dP (= dO·O in exact arithmetic) from the same rounded dP: its rounding cancels in
    # dP - delta, and the forward's output need not be kept. As batched dot products: no [.., s] temporary.
    delta = (probs.unsqueeze(-2) @ dprobs.unsqueeze(-1)).squeeze(-1)  # [B,K,g·t,1]
    dprobs.sub_(delta).mul_(probs).mul_(scale)
    dscores = dprobs.to(q.dtype)  # [B,K,g·t,s]
    del dprobs
    dq[:, :, r0:r1] = _unfold(dscores @ kb, heads)
    dk[:, :, :r1] += (dscores.transpose(-1, -2) @ qb).float()


def _backward(q, k, v, grad_out, scale: float, rows: int, block_probs):
    """dq, dk, dv from each query block's fp32 probabilities `block_probs(i, r0, r1)` -> [B,K,g·t,s]."""
    t = q.shape[2]
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # summed over blocks in fp32
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for i, r0 in enumerate(range(0, t, rows)):
        r1 = min(t, r0 + rows)
        _block_backward(block_probs(i, r0, r1), q, k, v, grad_out, r0, r1, scale, dq, dk, dv)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class FlashMatmulAttention(torch.autograd.Function):
    """out = softmax(q kᵀ·scale + mask) v by the flash kernel; backward by recomputed probabilities and GEMMs
    (memory.attention_backward: matmul).

    q [B,H,T,D]; k, v [B,K,T,D]; `mask`: None (causal) or additive [B or 1, 1, T, T] in q's dtype (0 / -inf,
    fitlm.models.layers.additive_mask) that allows no key after its query (document, window masks).
    Returns [B,H,T,D].
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, rows: int):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask is None, attn_mask=mask, scale=scale
        )  # [B,H,T,D], lse [B,H,T] fp32
        ctx.save_for_backward(q, k, v, lse, mask)
        ctx.scale, ctx.rows = scale, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lse, mask = ctx.saved_tensors
        b, kv_heads = q.shape[0], k.shape[1]
        g = q.shape[1] // kv_heads

        def recomputed(i: int, r0: int, r1: int) -> torch.Tensor:
            # exp(score - lse) in place: at most two [B,K,g,t,s] fp32 tensors (these and their gradient) at once.
            probs = _block_scores(q, k, mask, r0, r1, ctx.scale)  # [B,K,g,t,s]
            probs.sub_(lse[:, :, r0:r1].reshape(b, kv_heads, g, r1 - r0, 1)).exp_()
            return probs.view(b, kv_heads, g * (r1 - r0), r1)

        return *_backward(q, k, v, grad_out, ctx.scale, ctx.rows, recomputed), None, None, None


class SavedMatmulAttention(torch.autograd.Function):
    """The same attention with the forward too as blocked GEMMs (memory.attention_backward: matmul_saved): fp32
    scores and softmax per query block, and the probabilities kept for backward, which then recomputes nothing.
    Same arguments and contract as FlashMatmulAttention."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, rows: int):
        t = q.shape[2]
        out = torch.empty_like(q)
        kept = []
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            probs = _block_scores(q, k, mask, r0, r1, scale).softmax(-1)  # [B,K,g,t,s] fp32
            probs = probs.view(*probs.shape[:2], -1, r1)  # [B,K,g·t,s]
            out[:, :, r0:r1] = _unfold(probs.to(q.dtype) @ v[:, :, :r1], q.shape[1])
            kept.append(probs)
        ctx.save_for_backward(q, k, v, *kept)
        ctx.scale, ctx.rows = scale, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *kept = ctx.saved_tensors
        return *_backward(q, k, v, grad_out, ctx.scale, ctx.rows, lambda i, r0, r1: kept[i]), None, None, None


def _blocked_inputs(q, k, v, q_start: int, attn_mask, window, scale, softcap):
    """(q, k, v, additive mask or None, scale) for a blocked matmul attention where it applies -- training
    (gradients wanted) on CPU over a whole row (no KV cache) without soft-capping -- else None: decoding,
    evaluation, GPUs and Gemma 2's capped scores go to causal_attention unchanged."""
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not training or q.device.type != "cpu" or softcap is not None or q_start or q.shape[2] != k.shape[2]:
        return None
    if torch.is_autocast_enabled("cpu"):  # SDPA is a lower-precision op under CPU autocast: same casts
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask = attn_mask
    if window is not None:
        mask = restrict_mask(mask, band_mask(q.shape[2], k.shape[2], 0, window, q.device))
    if mask is not None:
        mask = additive_mask(mask, q.dtype) if mask.dtype == torch.bool else mask.to(q.dtype)
        if mask.dim() == 2:  # [T,S] -> [1,1,T,S]
            mask = mask[None, None]
    return q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale


# Two functions, not one closure over the autograd Function: torch.compile caches by code object, and one code
# object serving both would guard on which Function it closes over and recompile between them.
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int = 0,
    attn_mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """memory.attention_backward: matmul -- `fitlm.models.layers.causal_attention`'s contract, by
    FlashMatmulAttention where it applies (`_blocked_inputs`)."""
    args = _blocked_inputs(q, k, v, q_start, attn_mask, window, scale, softcap)
    if args is None:
        return causal_attention(q, k, v, q_start, attn_mask, window, scale, softcap)
    return FlashMatmulAttention.apply(*args, BLOCK_ROWS)


def attend_saved(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int = 0,
    attn_mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """memory.attention_backward: matmul_saved -- the same contract, by SavedMatmulAttention where it applies."""
    args = _blocked_inputs(q, k, v, q_start, attn_mask, window, scale, softcap)
    if args is None:
        return causal_attention(q, k, v, q_start, attn_mask, window, scale, softcap)
    return SavedMatmulAttention.apply(*args, BLOCK_ROWS)
