"""Data parallel and ZeRO in the plan: what the sharded parameters and the gradients of a data-parallel rank hold
beyond the model states (fitlm.plan.analytic.model_states shards those by the ZeRO stage), at the peak.

- ZeRO-2 keeps the gathered (separate, full) parameters from forward to backward.
- GRPO samples from the sharded weights: under ZeRO-2 the first forward gathers them until backward, under ZeRO-3
  each block and vocabulary table is gathered in its own forward (`_rollout_gathers`).
- ZeRO-3 regathers blocks in backward: the one computing and the prefetched next; QLoRA peaks in the last block's
  backward while it dequantizes (that block gathered, the next one's prefetch not yet issued: measured with
  MemTracker, one block, its NF4 codes, norms and adapters); over gloo each Linear is its own FSDP2 unit
  (fitlm.parallel.data_parallel): the one computing, the prefetched one's all-gather buffer and its copy-out, at
  most three of the largest.
- Gradients present during forward: none at accumulation step 1 (zero_grad frees them); with accumulation the
  earlier micro batches' gradients: unsharded while FSDP2 skips the sync (parallel.gradient_sync:
  last_micro_batch), their shards when it reduces every micro batch. DDP's gradients are views into its buckets,
  which live for the whole run (zero_grad only drops the views); micro batches that skip the sync accumulate into
  gradients of their own beside the buckets.
"""

from __future__ import annotations

from fitlm.plan import finetune as ft
from fitlm.plan import pipeline
from fitlm.plan.expert_parallel import stage_expert_params
from fitlm.plan.grpo import grpo
from fitlm.plan.setup import Setup, layer_params, param_bytes
from fitlm.plan.terms import Feature, Stage, Term

ZERO2 = "ZeRO-2 gathered parameters"
ZERO3 = "ZeRO-3 gathered blocks"
ZERO3_ROLLOUT = "ZeRO-3 blocks and vocabulary table gathered while sampling (GRPO)"
DDP_BUCKETS = "DDP buckets beside unsynced gradients"


def gathered_bytes(s: Setup) -> int:
    """Bytes of a parameter as FSDP2 gathers it: O2 gathers in half."""
    return 2 if s.level == "O2" else param_bytes(s)


def memory(st: Stage) -> list[Term]:
    s = st.s
    if not s.dims.fsdp_sharded:
        return []
    pb = gathered_bytes(s)
    # under expert parallel the stage's count leaves the experts to it (fitlm.plan.expert_parallel), 4-bit ones too
    part = False if s.ep > 1 else None
    nf4_n, nf4_gathered = ft.nf4_params(s, part), ft.nf4_rank_bytes(s, gathered=True, experts=part)
    unsharded = (st.dense - nf4_n) * pb + nf4_gathered  # NF4: its codes
    if s.zero == 2:  # (gathered at the first forward, GRPO's sampling's included, until backward)
        return [Term("other", ZERO2, unsharded)] + ([Term("other", ZERO2, unsharded, "rollout")] if grpo(s) else [])
    if nf4_n:
        dense_block = layer_params(s) - (stage_expert_params(s) / s.layers if s.ep > 1 else 0)
        staging = (dense_block + ft.rank_block_adapters(s) - nf4_n / s.layers) * pb + nf4_gathered / s.layers
    elif s.device_kind == "cpu" and not s.cfg.memory.compile:
        staging = 3 * max(i * o for _, i, o in s.counts.linears) / s.tp * pb
    else:
        staging = 2 * unsharded / max(1, st.layers)
    return [Term("other", ZERO3, staging, "backward"), *_rollout_gathers(s, staging, pb)]


def _rollout_gathers(s: Setup, staging: float, pb: int) -> list[Term]:
    """GRPO's sampling under ZeRO-3 (fitlm.parallel.data_parallel.whole_root): each block gathered in its forward
    as in training (the computing one and the prefetched next: `staging`), and a vocabulary table at a time (the
    embedding's lookup, the head's logits), except that a tied one is the root's, gathered for all of sampling."""
    if not grpo(s):
        return []
    table = s.vocab * s.h * pb / s.tp
    return [Term("other", ZERO3_ROLLOUT, table + staging if s.tied else max(table, staging), "rollout")]


def forward_grads(st: Stage, grads: float) -> tuple[float, list[Term]]:
    """Gradient bytes alive during forward and backward (before the backward moment's own), given the complete
    gradients of the step `grads`, and DDP's buckets where they stand beside them."""
    s = st.s
    held = st.trained * gathered_bytes(s) if s.dims.fsdp_sharded and not s.sync_every else grads
    if s.pp > 1:  # one schedule run per step: gradients exist once this stage has run a backward
        return held * pipeline.backward_share(s, st.first), []
    if s.dims.ddp:
        unsynced = s.accum > 1 and not s.sync_every
        return grads, [Term("other", DDP_BUCKETS, grads)] if unsynced else []
    return (0.0 if s.accum == 1 else held), []


FEATURE = Feature("data parallel and ZeRO", memory=memory)
