"""The decoder block's saved tensors per token, as the analytic engine counts them (see fitlm.plan.analytic's
docstring for the constants): the block itself, its attention's share (SDPA's log-sum-exp, or
memory.attention_backward's blocked matmul attention on a CPU), and what context parallel replaces.

Below the engine and fitlm.plan.finetune, which both read a block's bytes (a frozen block keeps less).
"""

from __future__ import annotations

from fitlm.models.matmul_attention import BLOCK_ROWS as ATTN_BLOCK_ROWS
from fitlm.plan import context_parallel as cp
from fitlm.plan.setup import Setup, act_bytes, per_block, stage_mean


def block_act_per_token(s: Setup) -> float:
    """Saved bytes per token of one block with no recompute, on one tensor-parallel rank; an MoE model's mean over
    its routed and dense blocks."""
    return per_block(s, _one_block)


def stage_act_per_token(s: Setup, first: bool) -> float:
    """`block_act_per_token` over the first or the last pipeline stage's own blocks (the model's without pipeline
    parallel)."""
    return stage_mean(s, first, _one_block)


def _one_block(s: Setup) -> float:
    rep, shard, kv, f, d = s.level_bytes()
    t = s.tp
    rep_h = rep * s.h / (t if s.sp else 1)
    if s.sp:  # the all-gathered inputs of q/k/v and gate/up stay full width (2 of the 6 replicated tensors)
        rep_h += 2 * act_bytes(s) * s.h * (1 - 1 / t)
    masked = s.doc_mask or s.sliding  # a masked SDPA expands k, v to every query head
    # (not context parallel's: its gathered k, v are attended unexpanded and counted per layer,
    # fitlm.plan.context_parallel)
    # (nor the blocked matmul attentions': they fold a key head's query heads onto it)
    gqa_repeat = (
        2 * act_bytes(s) * (s.q - s.kv) if masked and s.kv < s.q and s.cp == 1 and not blocked_attention(s) else 0
    )
    # Soft-capped eager attention keeps, per score, tanh's output and the fp32 softmax (8 bytes; the half
    # cast of the probabilities at half levels replaces nothing: 2 + 4 + 2).
    scores = 8 * s.heads * s.seq if s.softcap else 0
    return (
        rep_h
        + (shard * s.q + kv * s.kv + f * mlp_width(s) + gqa_repeat + scores + attention_kept(s)) / t
        + d * s.head_dim
        + 8
        - cp.local_kv_per_token(s)
        + routing_per_token(s)
    )


def routing_per_token(s: Setup) -> float:
    """What a routed block keeps beyond its MLP coefficients over the k experts' rows (fitlm.models.moe): the
    router's fp32 logits and softmax [N, E] (8E), the top-k weights and their renormalization (fp32, 8k), the
    sorted slots' token index (int64, 8k), the gathered rows x[token] [N·k, H] each expert reads, and the
    experts' outputs [N·k, H] their weights multiply (two activation copies of H per slot). 0 for a dense block.
    Under expert parallel the gathered rows are saved where the experts run, on the rank that receives them: that
    copy scales with `Setup.imbalance`; the outputs come back to the token's rank (N·k)."""
    if not s.counts.routed_ffn:
        return 0.0
    e, k = s.cfg.model.num_experts or 0, s.cfg.model.num_experts_per_tok
    return 8 * e + 16 * k + (1 + s.imbalance) * k * act_bytes(s) * s.h


def mlp_width(s: Setup) -> float:
    """The MLP width a token's saved activations cover on this rank: `Setup.ffn`, of which the k routed experts'
    share (k · I) is scaled by `Setup.imbalance` (the rows this rank's experts receive over the balanced N·k;
    1 but under a worst-case plan, fitlm.plan.routing). A shared expert runs every token on its own rank."""
    if s.imbalance == 1 or not s.counts.routed_ffn:
        return s.ffn
    m = s.cfg.model
    return s.ffn + (s.imbalance - 1) * m.num_experts_per_tok * m.expert_ffn_size


def blocked_attention(s: Setup) -> str | None:
    """memory.attention_backward's blocked matmul attention where it runs (a CPU, no context parallel, no soft-capped
    scores), else None."""
    kind = s.cfg.memory.attention_backward
    return kind if kind != "sdpa" and s.device_kind == "cpu" and s.cp == 1 and not s.softcap else None


def attended_keys(seq: int) -> float:
    """Keys a query row attends on average in the blocked matmul attention: each 128-row query block multiplies
    by the keys up to its last row (T/2 + 64 for T a multiple of 128)."""
    rows = ATTN_BLOCK_ROWS
    return sum(min(rows, seq - r0) * min(seq, r0 + rows) for r0 in range(0, seq, rows)) / seq


def attention_kept(s: Setup) -> float:
    """Bytes per token the attention itself keeps for backward, all heads: SDPA's fp32 log-sum-exp, or under
    memory.attention_backward: matmul_saved the fp32 probabilities of every attended score (no log-sum-exp)."""
    if blocked_attention(s) == "matmul_saved":
        return 4 * s.heads * attended_keys(s.seq)
    return 4 * s.heads
