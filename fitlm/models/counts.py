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

from dataclasses import replace

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
    linears: tuple[tuple[str, int, int], ...]
    groups: tuple[tuple[str, ...], ...]
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


def rope_planner(block_bytes: dict = LLAMA_BYTES, shape=None, **block_options) -> PlannerCounts:
    """PlannerCounts of a RoPE decoder: token embedding, blocks as `shape(cfg, **block_options)` (default
    `rope_block`; `moe_block` for a routed one), final norm."""
    shape = shape or rope_block
    return PlannerCounts(
        block=lambda cfg: shape(cfg, **{k: (v(cfg) if callable(v) else v) for k, v in block_options.items()}),
        embedding_params=lambda cfg: cfg.vocab_size * cfg.hidden_size,
        head_norm_params=lambda cfg: cfg.hidden_size,
        block_bytes=block_bytes,
        outside_bytes=LLAMA_OUTSIDE,
    )


def moe_block(cfg: ModelConfig, bias: bool = False, qk_norm: bool = False) -> BlockShape:
    """A routed block: attention as `rope_block`, the router [E, H], the E stacked experts counted as three
    linears of E·I outputs (their parameters; a token runs k of them), and Qwen2-MoE's gated shared expert."""
    dense = rope_block(cfg, bias=bias, qk_norm=qk_norm)
    h, ei = cfg.hidden_size, (cfg.num_experts or 0) * cfg.expert_ffn_size
    attention = tuple(lin for lin in dense.linears if lin[0] in ("q_proj", "k_proj", "v_proj", "o_proj"))
    routed: tuple[tuple[str, int, int], ...] = (
        ("gate", h, cfg.num_experts or 0),
        ("experts.gate_proj", h, ei),
        ("experts.up_proj", h, ei),
        ("experts.down_proj", ei, h),
    )
    s = cfg.shared_expert_intermediate_size or 0
    shared: tuple[tuple[str, int, int], ...] = (
        ("shared_expert.gate_proj", h, s),
        ("shared_expert.up_proj", h, s),
        ("shared_expert.down_proj", s, h),
        ("shared_expert_gate", h, 1),
    )
    groups = (dense.input_groups[0], tuple(name for name, _, _ in routed if name != "experts.down_proj"))
    return BlockShape(attention + routed + (shared if s else ()), groups, dense.extra_params)


def moe_planner(block_bytes: dict = LLAMA_BYTES, **block_options) -> PlannerCounts:
    """PlannerCounts of a routed RoPE decoder (`moe_block`), with `rope_block` for the dense blocks among the routed
    ones; a routed block's activations are the dense block's coefficients over its routed rows' width
    (fitlm.plan.blocks)."""
    counts = rope_planner(block_bytes, moe_block, **block_options)
    dense = rope_planner(block_bytes, rope_block, **block_options).block
    return replace(counts, dense_block=dense)
