"""Expert parallel's planner terms (parallel.expert_parallel = ep > 1), as fitlm.parallel.expert_parallel runs it.

- Each rank holds E/ep of every MoE block's stacked experts (3 matrices of E·I × H: `experts.*` in the family's
  block counts), and those are not sharded by ZeRO: FSDP2 leaves them to expert parallel, which keeps each
  rank's experts whole and sums their gradients over the ranks that hold the same experts (edp). So their
  parameters, gradients and optimizer states are counted at ZeRO 0, on the E/ep a rank holds; the rest of the
  model is counted as before.
- The dispatch keeps one MoE layer's send and receive buffers of the routed rows (tokens × top-k × H) while
  the layer runs: an `other` part.
- Each MoE layer runs four all-to-alls of those rows per micro batch (dispatch and combine, forward and
  backward); a rank keeps 1/ep of them and sends the rest over the link.

The planner counts every block as a routed one (fitlm.models.counts.moe_block), and so do these terms.
"""

from __future__ import annotations

from dataclasses import replace

from fitlm.plan.setup import Setup

A2A_BUFFERS = "expert-parallel all-to-all buffers"


def stage_expert_params(s: Setup) -> int:
    """Parameters of all experts of the blocks a rank's stage holds (before expert parallel splits them)."""
    per_block = sum(i * o for name, i, o in s.counts.linears if name.startswith("experts."))
    return s.layers * per_block


def local_expert_params(s: Setup) -> float:
    """The experts a rank holds: E/ep of every MoE block's."""
    return stage_expert_params(s) / s.ep


def routed_rows(s: Setup, tokens: float) -> float:
    """Rows one MoE layer dispatches for `tokens` tokens: each goes to its top-k experts."""
    return tokens * s.cfg.model.num_experts_per_tok


def alltoall_buffers(s: Setup, tokens: float, act_bytes: int) -> float:
    """One layer's send and receive buffers of the routed rows (H wide, in the activation dtype)."""
    return 2 * routed_rows(s, tokens) * s.h * act_bytes if s.ep > 1 else 0.0


def alltoall_seconds(
    s: Setup, tokens_per_micro_batch: float, act_bytes: int, bandwidth: float, latency_s: float
) -> float:
    """A step's all-to-all time: 4 per MoE layer per micro batch, each moving the (ep-1)/ep of the routed rows
    that leave the rank at `bandwidth` (bytes/s) after `latency_s` per peer."""
    if s.ep == 1:
        return 0.0
    leaving = routed_rows(s, tokens_per_micro_batch) * s.h * act_bytes * (s.ep - 1) / s.ep
    return 4 * s.layers * s.accum * (leaving / bandwidth + latency_s * (s.ep - 1))


def expert_states(s: Setup, model_states) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, host) bytes of a rank's experts: E/ep, at ZeRO 0 (see the module docstring).
    Trained under full fine-tuning, frozen under LoRA (its targets are attention's), trained above the frozen
    bottom under freeze. `model_states` is fitlm.plan.analytic's, passed in so that this module stays below it."""
    local = local_expert_params(s)
    trained = {"full": local, "freeze": local * (1 - s.freeze_layers)}.get(s.method, 0.0)
    return model_states(replace(s, zero=0), local, trained)


__all__ = [
    "A2A_BUFFERS",
    "alltoall_buffers",
    "alltoall_seconds",
    "expert_states",
    "local_expert_params",
    "stage_expert_params",
]
