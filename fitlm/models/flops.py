"""What a token costs a model: the parameters that take part in a matmul, and training FLOPs per token."""

from __future__ import annotations

import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.models.moe import moe_layers


def is_embedding(name: str) -> bool:
    """Whether a parameter name is an embedding table (a lookup, not a matmul; never weight-decayed)."""
    return "embed" in name or name.endswith(("wte.weight", "wpe.weight"))


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in a matmul per token: everything except embedding lookups.

    The output projection counts (it is a matmul) even when tied to the input embedding; of an MoE layer's
    E stacked experts, the k a token is routed to.
    """
    # named_parameters() lists a tied weight once, under its first (embedding) name.
    named = dict(model.named_parameters())
    total = sum(p.numel() for n, p in named.items() if not is_embedding(n))
    for m in moe_layers([model]):  # a token runs k of an MoE layer's E experts
        stacked = sum(p.numel() for p in m.experts.parameters())
        total -= stacked - stacked * m.top_k // m.experts.num_experts
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and "lm_head.weight" not in named:
        total += lm_head.weight.numel()
    return total


def flops_per_token(model: nn.Module, cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (forward 2N + backward 4N) plus attention 12·L·h·s (PaLM, App. B).

    The attention term is counted in full, not halved for the causal mask, as PaLM and most peers do.
    """
    return 6.0 * matmul_params(model) + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
