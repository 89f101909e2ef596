"""Attention whose backward runs as batched matmuls (memory.attention_backward: matmul, applied by
fitlm.memory.attention_backward).

The forward is SDPA's CPU flash kernel itself (the same output, bit for bit, and its row log-sum-exp). The
backward recomputes the probabilities from that log-sum-exp and differentiates with five batched GEMMs
instead of the flash kernel's own backward, which on CPU is the slow part of attention in half precision
(B 8, H 4, T 256, D 64, bf16 on a 2-core AMX CPU, forward + backward compiled: SDPA 11.8 ms, this 6.9 ms).
The catch is memory and long rows: it holds [B, H, t, S] scores for a block of t query rows, so past ~512
keys the flash kernel (which never holds them) wins again (T 1,024: 42.9 vs 48.7 ms), and in fp32 it is no
faster. Hence opt-in, for short-row half-precision training on CPU (bench/train_throughput.py).

Queries go through in blocks of BLOCK_ROWS rows: a block attends only keys up to its last row (the causal
rule; fitlm's document and sliding-window masks only ever narrow it), so masked-out score blocks are never
computed, and the scores held at once are one block's: [B, H, 128, S] fp32 probabilities and their gradient,
with half copies of both.

Grouped-query attention: a block's query heads are folded onto their key/value head ([B,K,g·t,D]), so one
GEMM per product serves the group and dK, dV come out summed over it, with no expanded copies of k and v.

Shapes: B batch, H query heads, K key/value heads (g = H/K), T query rows = S keys, D head dim.
"""

from __future__ import annotations

import torch

from fitlm.models.layers import _band_mask, _restrict, additive_mask, causal_attention

# Query rows per backward block. Measured forward + backward, compiled, bf16, 2-core AMX CPU (ms, SDPA / one
# block of all rows / 128 / 64): B8 H4 K2 T256 11.8 / 8.5 / 6.9 / 6.8; B8 H6 T256 19.2 / 12.8 / 11.2 / 12.5;
# B4 H8 K2 T512 34.3 / 43.6 / 19.4 / 22.0; B2 H8 T1024 42.9 / 90.0 / 48.7 / 65.3.
BLOCK_ROWS = 128


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B,H,t,D] -> [B,K,g·t,D]: each key/value head's query heads stacked along the rows."""
    b, h, t, d = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * t, d)


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B,K,g·t,D] -> [B,H,t,D]."""
    b, k, gt, d = x.shape
    return x.reshape(b, heads, gt * k // heads, d)


class FlashMatmulAttention(torch.autograd.Function):
    """out = softmax(q kᵀ·scale + mask) v by the flash kernel; backward by recomputed probabilities and GEMMs.

    q [B,H,T,D]; k, v [B,K,T,D]; `mask`: None (causal) or additive [B or 1, 1, T, T] in q's dtype (0 / -inf,
    fitlm.models.layers.additive_mask) that allows no key after its query (document, window masks).
    Returns [B,H,T,D].
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, rows: int):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask is None, attn_mask=mask, scale=scale)  # [B,H,T,D], lse [B,H,T] fp32
        ctx.save_for_backward(q, k, v, lse, mask)
        ctx.scale, ctx.rows = scale, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lse, mask = ctx.saved_tensors
        heads, kv_heads, t = q.shape[1], k.shape[1], q.shape[2]
        g = heads // kv_heads
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # summed over blocks in fp32
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for r0 in range(0, t, ctx.rows):
            r1 = min(t, r0 + ctx.rows)
            s_end = r1  # the block's last query sees keys 0..r1-1; the masks fitlm builds never allow later keys
            qb = _fold(q[:, :, r0:r1], kv_heads)  # [B,K,g·t,D]
            gob = _fold(grad_out[:, :, r0:r1], kv_heads)
            kb, vb = k[:, :, :s_end], v[:, :, :s_end]  # [B,K,s,D]
            # The scores in fp32: rounded to half, exp() would carry their rounding (~0.4% of a score of 5) into every
            # gradient; so computed, the gradients are as close to fp64 as SDPA's own backward (tested). In place from
            # here on: at most two [B,K,g,t,s] fp32 tensors (the probabilities and their gradient) exist at once.
            probs = (qb.float() @ kb.float().transpose(-1, -2)).view(*qb.shape[:2], g, r1 - r0, s_end)  # [B,K,g,t,s]
            probs.mul_(ctx.scale).sub_(lse[:, :, r0:r1].reshape(lse.shape[0], kv_heads, g, r1 - r0, 1))
            if mask is None:
                rows = torch.arange(r0, r1, device=q.device)[:, None]
                probs.masked_fill_(torch.arange(s_end, device=q.device)[None, :] > rows, float("-inf"))  # later keys
            else:
                probs.add_(mask[:, :, r0:r1, :s_end].unsqueeze(2))  # [B|1,1,1,t,s], 0 / -inf
            probs.exp_()
            flat = probs.view(*probs.shape[:2], g * (r1 - r0), s_end)  # [B,K,g·t,s]
            dv[:, :, :s_end] += (flat.to(q.dtype).transpose(-1, -2) @ gob).float()
            dprobs = (gob @ vb.transpose(-1, -2)).float()  # [B,K,g·t,s]
            # The row term sum_j P·dP (= dO·O in exact arithmetic) from the same rounded dP: its rounding cancels in
            # dP - delta, and the forward's output need not be kept. As batched dot products: no [.., s] temporary.
            delta = (flat.unsqueeze(-2) @ dprobs.unsqueeze(-1)).squeeze(-1)  # [B,K,g·t,1]
            dprobs.sub_(delta).mul_(flat).mul_(ctx.scale)
            del probs, flat
            dscores = dprobs.to(q.dtype)  # [B,K,g·t,s]
            del dprobs
            dq[:, :, r0:r1] = _unfold(dscores @ kb, heads)
            dk[:, :, :s_end] += (dscores.transpose(-1, -2) @ qb).float()
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int = 0,
           attn_mask: torch.Tensor | None = None, window: int | None = None, scale: float | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """`fitlm.models.layers.causal_attention`'s contract, with the matmul backward where it applies: training
    (gradients wanted) on CPU over a whole row (no KV cache) without soft-capping. Everything else -- decoding,
    evaluation, GPUs, Gemma 2's capped scores -- goes to causal_attention unchanged."""
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not training or q.device.type != "cpu" or softcap is not None or q_start or q.shape[2] != k.shape[2]:
        return causal_attention(q, k, v, q_start, attn_mask, window, scale, softcap)
    if torch.is_autocast_enabled("cpu"):  # SDPA is a lower-precision op under CPU autocast: same casts
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask = attn_mask
    if window is not None:
        mask = _restrict(mask, _band_mask(q.shape[2], k.shape[2], 0, window, q.device))
    if mask is not None:
        mask = additive_mask(mask, q.dtype) if mask.dtype == torch.bool else mask.to(q.dtype)
        if mask.dim() == 2:  # [T,S] -> [1,1,T,S]
            mask = mask[None, None]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return FlashMatmulAttention.apply(q, k, v, mask, scale, BLOCK_ROWS)
