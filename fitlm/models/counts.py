"""Planner counts of the RoPE decoder blocks (fitlm.models.decoder), for the families' PlannerCounts.

Saved-activation coefficients are bytes per token per block, on (replicated h, query width H·D, kv
width K·D, ffn, head_dim), no recompute; fitlm.plan.analytic explains the Llama count line by line:
  - each pre-norm feeding a matmul keeps its input (fp32 copy for the statistics), its normalised
    output and the matmul input: O0 12h, O2/O3 8h, O1 (fp32 residual, one autocast copy per consumer)
    4h + 4h + 2h per consumer -- Llama: 24 / 26 / 16 / 16 for its two norms;
  - queries: rotated q and the attention output (2 per element); keys/values: rotated k and v;
  - SwiGLU/GeGLU: gate, act(gate), up, their product (4 per ffn element);
  - half levels keep 8 bytes per head_dim of cos/sin casts.
Gemma's sandwich adds two post-norms whose outputs are not matmul inputs (input + normalised: O0 8h,
half levels 4h + 4h since the (1 + w) product is taken in fp32), and its pre-norms keep the fp32
normalised tensor (O2: 4 + 4 + 2 = 10h each). q/k norms (Qwen3, Gemma 3) keep the projection output
and the normalised one per element: +8 (O0) / +6 (half levels; +8 with Gemma's fp32 product).
"""

from __future__ import annotations

from fitlm.config import ModelConfig
from fitlm.models.family import BlockShape, PlannerCounts

LEVELS = ("O0", "O1", "O2", "O3")
# Llama block: (replicated h, q width, kv width, ffn, head_dim) per level.
LLAMA_BYTES = {"O0": (24, 8, 8, 16, 0), "O1": (26, 4, 4, 8, 8), "O2": (16, 4, 4, 8, 8), "O3": (16, 4, 4, 8, 8)}
GEMMA_BYTES = {"O0": (40, 8, 8, 16, 0), "O1": (42, 4, 4, 8, 8), "O2": (36, 4, 4, 8, 8), "O3": (36, 4, 4, 8, 8)}
# Outside the blocks: the final norm's saved tensors (h) and RoPE gathers (head_dim).
LLAMA_OUTSIDE = {"O0": (12, 8), "O1": (10, 0), "O2": (8, 0), "O3": (8, 0)}
QK_NORM = {"O0": 8, "O1": 6, "O2": 6, "O3": 6}
QK_NORM_UNIT_OFFSET = {"O0": 8, "O1": 8, "O2": 8, "O3": 8}


def with_qk_norm(block_bytes: dict, extra: dict) -> dict:
    return {lv: (r, q + extra[lv], kv + extra[lv], f, d) for lv, (r, q, kv, f, d) in block_bytes.items()}


def rope_block(
    cfg: ModelConfig, bias: bool = False, qk_norm: bool = False, norms: int = 2, fused: bool = False
) -> BlockShape:
    """Linears of one pre-norm/sandwich block: q/k/v/o (or Phi-3's fused qkv), gate/up/down."""
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.ffn_size
    if fused:
        linears = (("qkv_proj", h, q + 2 * kv), ("o_proj", q, h), ("gate_up_proj", h, 2 * f), ("down_proj", f, h))
        groups = (("qkv_proj",), ("gate_up_proj",))
    else:
        linears = (
            ("q_proj", h, q),
            ("k_proj", h, kv),
            ("v_proj", h, kv),
            ("o_proj", q, h),
            ("gate_proj", h, f),
            ("up_proj", h, f),
            ("down_proj", f, h),
        )
        groups = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    extra = norms * h + (q + 2 * kv if bias else 0) + (2 * cfg.head_size if qk_norm else 0)
    return BlockShape(linears, groups, extra)


def rope_planner(block_bytes: dict = LLAMA_BYTES, **block_options) -> PlannerCounts:
    """PlannerCounts of a RoPE decoder: token embedding, blocks as `rope_block(**block_options)`, final norm."""
    return PlannerCounts(
        block=lambda cfg: rope_block(cfg, **{k: (v(cfg) if callable(v) else v) for k, v in block_options.items()}),
        embedding_params=lambda cfg: cfg.vocab_size * cfg.hidden_size,
        head_norm_params=lambda cfg: cfg.hidden_size,
        block_bytes=block_bytes,
        outside_bytes=LLAMA_OUTSIDE,
    )
