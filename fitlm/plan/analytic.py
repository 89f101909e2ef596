"""The analytic engine: per-device bytes by component, in closed form, explainable line by line.

Constants are derived for fitlm's Llama (RMSNorm, RoPE, GQA, SwiGLU, SDPA, no dropout) by counting
the tensors its backward actually saves, and checked against the simulate engine (which runs the real
step on fake tensors). Units below: bytes per token per block; h hidden, kv = kv_heads·head_dim,
f MLP width, D head dim, H heads. At O0 one block keeps, in fp32:
  - replicated (full width even under tensor parallel): block input x, norm1's normalised r1 and its
    output n1 (input of q/k/v), residual x1, norm2's r2 and n2 (input of gate/up)       6h
  - head-sharded: rotated q, attention output (= o_proj input)                               2h
  - rotated k and v                                                                           2kv
  - SwiGLU: gate, silu(gate), up, their product (down's input)                                4f
  - SDPA log-sum-exp (fp32) 4H (memory.attention_backward: matmul_saved keeps fp32 probabilities
    instead: attention_kept) and two rsqrt rows (8 bytes)
Half levels keep most of these in 2 bytes, but RMSNorm's fp32 statistics keep an fp32 copy of its
input (and O1 keeps the residual stream in fp32), and RoPE keeps half casts of cos/sin (8D). O1 also
keeps, per block, the half casts of its weights that the matmuls saved (2 bytes per parameter); O2
casts them again in backward instead, except where recompute, compile, FSDP2 or tensor parallel take over
(fitlm.memory.precision.recasts_in_backward).
Korthikanti et al.'s GPT constant (34·s·b·h) does not transfer: no dropout masks, a 3-matrix MLP, GQA.
Fine-tuning (LoRA, QLoRA, freeze) changes what trains, what the frozen weights cost and what a block saves
(QLoRA's dequantization working set is a named part of the backward moment), and DPO doubles the rows of a micro
batch and may keep a frozen reference copy (`other`): see fitlm.plan.finetune.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitlm.memory.precision import recasts_in_backward
from fitlm.models.matmul_attention import BLOCK_ROWS as ATTN_BLOCK_ROWS
from fitlm.plan import context_parallel as cp
from fitlm.plan import expert_parallel as ep
from fitlm.plan import finetune as ft
from fitlm.plan.activation_offload import RESIDENT_BLOCKS, offload
from fitlm.plan.setup import LEVELS, Setup, embedding_params, head_params, layer_params, stage_layers

# Per-level block constants live with each family (fitlm.models.counts, PlannerCounts.block_bytes):
# (replicated h, query width, kv, f, D) bytes per token per block, no recompute; the Llama block's are
# counted above. Outside the blocks (PlannerCounts.outside_bytes): the final norm's saved tensors and
# the RoPE tables gathered per position, as (h-coefficient, D-coefficient); the logits path is separate.
# Plain loss path, bytes per token per vocabulary entry: logits, their fp32 log-softmax, and the logits
# gradient that exists at the start of backward (the peak): 3 fp32-sized values in every level.
LOGIT_BYTES = 12
# Under tensor parallel the loss runs on vocab-sharded logits (torch's loss_parallel), whose backward keeps
# one more fp32 value per local logit (its one-hot gradient beside exp(log-softmax) and their sum): 16 bytes.
# (20 was fitted to a simulation that also counted DTensor's global-shape metadata run: fitlm.plan.fake_world.)
LOGIT_BYTES_TP = 16
WEIGHT_CAST = {"O0": 0, "O1": 2, "O2": 2, "O3": 0}  # half weight copies saved by the matmuls, per parameter
REFERENCE = (
    "DPO reference model (frozen, unsharded)"  # the part of `other` that fitlm.plan.finetune.reference_bytes counts
)
ATTN_BACKWARD = (
    "matmul attention backward (one query block's scores)"  # a part of `activations` (attention_backward_bytes)
)
ATTN_PROBS = (
    "matmul_saved attention probabilities (fp32, kept for backward)"  # a part of `activations` (kept_probabilities)
)


def param_bytes(s: Setup) -> int:
    return 2 if s.level == "O3" else 4


def act_bytes(s: Setup) -> int:
    return 4 if s.level == "O0" else 2


def residual_bytes(s: Setup) -> int:
    return 4 if s.level in ("O0", "O1") else 2


@dataclass(frozen=True)
class Breakdown:
    """Bytes on the most loaded device at its peak; `total` is their sum."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    other: int
    phase: str  # when the peak happens: "forward/backward" or "optimizer step"
    host: int = 0  # bytes kept in host memory by offload
    other_parts: tuple[tuple[str, int], ...] = ()  # what `other` holds, by name; they sum to `other`
    # Named shares of `activations` (the rest is the blocks' and the embedding's saved tensors), e.g. context
    # parallel's gathered K/V; and the activations memory.activation_offload keeps on the host (within `host`).
    activation_parts: tuple[tuple[str, int], ...] = ()
    host_activations: int = 0
    param_parts: tuple[tuple[str, int], ...] = ()  # named shares of `params` (QLoRA's NF4 weights)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.other

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "other": self.other,
            "total": self.total,
        }


def stage_params(s: Setup, first: bool) -> int:
    """The base model's parameters held by one pipeline rank before any sharding (first or last stage);
    LoRA adapters are split differently (`rank_params`)."""
    if s.pp == 1:
        return embedding_params(s) + s.layers * layer_params(s) + head_params(s)
    own = stage_layers(s) * layer_params(s)
    if first:
        return own + embedding_params(s)
    # The last stage keeps the head; a tied head is a copy of the embedding there.
    return own + head_params(s) + (s.vocab * s.h if s.tied else 0)


def tp_share(s: Setup, n: int) -> float:
    """Tensor parallel shards every matrix (embedding and head by vocabulary); norms are tiny."""
    return n / s.tp


def rank_params(s: Setup, first: bool) -> float:
    """Parameters on one rank of the first or last stage before ZeRO: the base split by tp, and the stage's
    LoRA adapters, whose A (column-parallel) or B (row-parallel) stays whole (fitlm.plan.finetune)."""
    return tp_share(s, stage_params(s, first)) + len(ft.stage_blocks(s, first)) * ft.rank_block_adapters(s)


def block_act_per_token(s: Setup) -> float:
    """Saved bytes per token of one block with no recompute, on one tensor-parallel rank."""
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
        + (shard * s.q + kv * s.kv + f * s.ffn + gqa_repeat + scores + attention_kept(s)) / t
        + d * s.head_dim
        + 8
        - cp.local_kv_per_token(s)
    )


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


def kept_probabilities(s: Setup, tokens: float, layers: int, in_flight: float) -> float:
    """The part of the kept activations that is matmul_saved's probabilities (all but the blocks full recompute
    rebuilds keep them; selective recompute keeps the score matmuls' outputs, as many bytes)."""
    if blocked_attention(s) != "matmul_saved":
        return 0.0
    keeping = layers - (-(-layers // max(1, s.recompute_every)) if s.recompute == "full" else 0)
    return in_flight * keeping * tokens * attention_kept(s) / s.tp


def attention_kept(s: Setup) -> float:
    """Bytes per token the attention itself keeps for backward, all heads: SDPA's fp32 log-sum-exp, or under
    memory.attention_backward: matmul_saved the fp32 probabilities of every attended score (no log-sum-exp)."""
    if blocked_attention(s) == "matmul_saved":
        return 4 * s.heads * attended_keys(s.seq)
    return 4 * s.heads


def block_act_recompute(s: Setup, tokens: float) -> float:
    """Bytes one block keeps across its forward under recompute (per block, for `tokens` tokens)."""
    per_token = block_act_per_token(s)
    if s.recompute == "full":
        width = s.h / (s.tp if s.sp else 1)
        return tokens * residual_bytes(s) * width  # only the block input
    if s.recompute == "selective":  # matmul and SDPA outputs: q, k, v, attention, o, gate, up, down (+ input)
        e, t = act_bytes(s), s.tp
        width = s.h / (t if s.sp else 1)
        # (matmul_saved: its score matmuls' fp32 outputs are the saved matmul outputs, as many bytes as its
        # probabilities)
        return tokens * (
            residual_bytes(s) * width
            + e * (2 * s.q + 2 * s.kv + 2 * s.ffn) / t
            + 2 * e * width
            + attention_kept(s) / t
            - cp.local_kv_per_token(s)
        )
    return tokens * per_token


def activations(
    s: Setup, tokens: float, layers: int, in_flight: float, first: bool = True
) -> tuple[float, float, float]:
    """(kept, casts, working): saved activations of `layers` blocks for `in_flight` micro-chunks of `tokens`
    tokens each, the saved half weight copies among them, and -- under recompute -- the extra working set of
    the one block rebuilt in backward (a second peak candidate, after the logits are freed). `first`: the
    blocks are the first pipeline stage's (else the last's), which fine-tuning trains differently."""
    every = max(1, s.recompute_every)
    recomputed = 0 if s.recompute == "none" else -(-layers // every)
    plain = layers - recomputed
    kept = in_flight * (plain * tokens * block_act_per_token(s) + recomputed * block_act_recompute(s, tokens))
    kept += in_flight * gathered_layers(s, layers) * cp.gathered_kv(s)  # context parallel: full-length K/V
    casts = WEIGHT_CAST[s.level] * layer_params(s) / s.tp
    if s.level == "O2" and s.dims.fsdp_sharded:
        casts = 0  # FSDP2's policy gathers half parameters instead (counted under `other`)
    elif recasts(s):
        casts = 0  # the saved half weights are cast again in backward, not kept (fitlm.memory.precision)
    if s.method != "full":  # frozen blocks keep less: average over this stage's own blocks (per tp rank)
        blocks = ft.stage_blocks(s, first)
        saved = sum(ft.block_savings(s, b) for b in blocks) / len(blocks)
        kept -= in_flight * plain * tokens * saved
        if casts:
            casts = WEIGHT_CAST[s.level] * sum(ft.block_cast_params(s, b) for b in blocks) / len(blocks)
    working = tokens * block_act_per_token(s) + casts + cp.gathered_kv(s) if recomputed else 0.0
    return kept + plain * casts, plain * casts, working  # saved half weights are shared by the in-flight chunks


def gathered_layers(s: Setup, layers: int) -> int:
    """Blocks whose gathered K/V (context parallel) stay from forward to backward: all but those full recompute
    rebuilds (selective recompute keeps the attention inputs)."""
    if s.recompute != "full":
        return layers
    return layers - -(-layers // max(1, s.recompute_every))


# memory.attention_backward: matmul / matmul_saved (fitlm.models.matmul_attention) hold, inside one block's backward,
# one query block's scores: [rows, H/tp, 128, T] for the last block, which sees every key. Measured (MemTracker, bf16,
# B 8, H 4, K 2, T 512, D 64), matmul: 4 bytes per score compiled (inductor fuses the chain), 8.5 eager (fp32
# probabilities and their gradient, a half copy, not all alive at once); matmul_saved keeps the probabilities (counted
# in attention_kept), so its backward adds the gradient and half copies only (6, estimated: its peak is the end of
# forward, so no step measures it). Plus the fp32 dK and dV accumulators. Only matmul's eager figure is checked
# against a whole training step (tests/unit/test_plan.py): MemTracker's dispatch mode makes torch.compile run eagerly.
ATTN_SCORE_BYTES = {("matmul", True): 4, ("matmul", False): 8.5, ("matmul_saved", True): 4, ("matmul_saved", False): 6}


def attention_backward_bytes(s: Setup, rows: float) -> float:
    """The blocked matmul attention's working set in one block's backward, for `rows` sequences (0 where it does
    not run: SDPA's own backward, a GPU, context parallel)."""
    kind = blocked_attention(s)
    if kind is None:
        return 0.0
    scores = rows * s.heads / s.tp * min(ATTN_BLOCK_ROWS, s.seq) * s.seq
    accumulators = 2 * rows * s.kv_heads / s.tp * s.seq * s.head_dim * 4
    return scores * ATTN_SCORE_BYTES[kind, bool(s.cfg.memory.compile)] + accumulators


def logits_bytes(s: Setup, tokens: float) -> float:
    """The output layer's activations: whole logits (+ log-softmax + gradient) or one chunk of them."""
    v = s.vocab / s.tp
    if s.loss_chunk:
        chunk = min(s.loss_chunk, tokens)
        # One fp32 [chunk, V] buffer updated in place (logits -> softmax -> gradient), beside it the half
        # matmul output or the gradient cast back to half when computing in half; the running fp32 weight
        # gradient [V, h] (accumulated in place in fp32, through a half product cast up otherwise); the
        # hidden gradient.
        half = act_bytes(s) < 4
        per_logit = 4 + (2 if half else 0)
        # (none for a frozen head: LoRA, or freeze with the embeddings and a tied head)
        weight_grad = v * s.h * (4 + (6 if half else 0)) if ft.head_trains(s) else 0.0
        return chunk * v * per_logit + weight_grad + tokens * s.h * act_bytes(s)
    fsdp_casts = s.level == "O2" and s.dims.fsdp_sharded  # FSDP2 gathers half weights instead
    half_frozen = ft.frozen_in_half(s) and not ft.head_trains(s)  # a frozen head stored in half needs no cast
    cast = 0 if fsdp_casts or half_frozen else WEIGHT_CAST[s.level] * s.vocab * s.h / s.tp
    return tokens * v * (LOGIT_BYTES_TP if s.tp > 1 else LOGIT_BYTES) + cast


def outside_bytes(s: Setup, tokens: float) -> float:
    a, d = s.counts.outside_bytes[LEVELS.index(s.level)]
    return tokens * (a * s.h / (s.tp if s.sp else 1) + d * s.head_dim + 12 - ft.outside_savings(s))


def model_states(s: Setup, n: float, trained: float | None = None) -> tuple[float, float, float, float]:
    """(params, grads at rest, optimizer, host) bytes for `n` parameters on this rank, `trained` of them
    trainable (default all), per ZeRO stage.

    fitlm's levels fix the per-parameter bytes: params and grads in the parameter dtype (fp32, or half
    at O3) and AdamW's two moments in it too; O2's half copies are transient (activations/other).
    Frozen parameters (LoRA, freeze) have neither gradients nor states, and O2 stores them in half; QLoRA's
    NF4 weights (`ft.nf4_params` of the `n`) hold their 4-bit bytes, per shard as ZeRO-2/3 split them.
    """
    pb = param_bytes(s)
    trained = n if trained is None else trained
    frozen_pb = 2 if ft.frozen_in_half(s) else pb
    d = s.dims  # what the ZeRO stage shards (fitlm.parallel_dims.ZERO_STAGES)
    opt_shard = d.shard_factor("optimizer")
    frozen = n - trained - ft.nf4_params(s)
    params = (trained * pb + frozen * frozen_pb) / d.shard_factor("params") + ft.nf4_rank_bytes(s)
    grads, opt = trained * pb / d.shard_factor("grads"), 2 * trained * pb / opt_shard
    host = 0.0
    if s.offload:
        host, opt = opt, 0.0  # AdamW's moments
        if s.dims.fsdp_sharded:  # FSDP2's CPU shards: the fp32 parameters (the master itself) and gradients
            host += params + grads
            params = grads = 0.0
        else:
            host += trained * 4 / opt_shard  # HostAdamW's fp32 master copy; the device keeps its parameters
    return params, grads, opt, host


def recasts(s: Setup) -> bool:
    """fitlm.memory.precision.recasts_in_backward for this variant."""
    return recasts_in_backward(
        s.level,
        s.recompute,
        s.cfg.memory.compile,
        s.dims.fsdp_sharded,
        s.tp,
        offload=s.cfg.memory.activation_offload is not False,
    )


def foreach_adamw(s: Setup) -> bool:
    """fitlm.step.optim.uses_fused, by layout: sharded DTensor parameters (FSDP2, tensor parallel) step with
    foreach AdamW, plain tensors (one device, DDP, ZeRO-1, pipeline stages) with the fused kernel."""
    return s.dims.fsdp_sharded or s.tp > 1


def breakdown(s: Setup) -> Breakdown:
    """The most loaded rank's peak: the larger of the forward/backward peak and the optimizer-step peak,
    on the first pipeline stage (embedding + most in-flight chunks) or the last (logits), whichever is higher."""
    results = [_stage(s, first=True)] + ([_stage(s, first=False)] if s.pp > 1 else [])
    return max(results, key=lambda b: b.total)


def _stage(s: Setup, first: bool) -> Breakdown:
    n = rank_params(s, first)
    trained = n if s.method == "full" else ft.stage_trainable(s, first)
    experts = ep.stage_expert_params(s) if s.ep > 1 else 0  # counted apart: E/ep per rank, at ZeRO 0
    n -= experts
    trained -= experts if s.method == "full" else 0
    params, grads_full, opt, host = (
        a + b for a, b in zip(model_states(s, n, trained), ep.expert_states(s, model_states) if experts else (0,) * 4)
    )
    in_flight: float  # micro batches (chunks) whose activations are alive at the peak
    if s.pp > 1:
        tokens = s.rows / max(1, s.chunks) * s.seq  # one pipeline chunk
        layers = stage_layers(s) if s.schedule != "interleaved_1f1b" else 2 * -(-s.layers // (2 * s.pp))
        step_chunks = s.step_chunks  # one schedule run per step: its warm-up counts the chunks of every micro batch
        if s.schedule == "gpipe":
            in_flight = step_chunks
        elif s.schedule == "interleaved_1f1b":  # rank r's forwards before its first backward (torch's
            # _get_warmup_ops: one round per extra local stage, two per hop from the last rank), then one more;
            # counted in (chunk, local stage) pairs over the rank's 2 stages
            rank = 0 if first else s.pp - 1
            per_round = step_chunks // max(1, step_chunks // s.pp)
            in_flight = min(per_round + 2 * (s.pp - 1 - rank) + 1, 2 * step_chunks) / 2
        else:
            in_flight = min(step_chunks, s.pp) if first else 1
        has_logits = not first
    else:
        tokens, layers, in_flight, has_logits = s.rows * s.local_seq, s.layers, 1, True  # T/C under context parallel
    kept, casts, working = activations(s, tokens, layers, in_flight, first)
    outside = in_flight * outside_bytes(s, tokens) * (1 if has_logits else 0.5)
    moved = offload(s, kept - casts, layers, outside)  # memory.activation_offload (fitlm.plan.activation_offload)
    kept, outside, host_act = moved.blocks + casts, moved.outside, moved.host
    act_parts = {
        cp.GATHERED: in_flight * gathered_layers(s, layers) * cp.gathered_kv(s),
        ATTN_PROBS: kept_probabilities(s, tokens, layers, in_flight),
    }
    if host_act:
        act_parts[cp.GATHERED] *= min(layers, RESIDENT_BLOCKS) / layers  # the rest went to the host with its blocks
    logit = logits_bytes(s, tokens) if has_logits else 0.0
    rope = s.counts.rope_tables * 2 * s.max_seq_len * s.head_dim * 4  # RoPE cos/sin tables (buffers)
    # (REFERENCE: the DPO copy, which lives all run)
    parts: dict[str, float] = {"RoPE cos/sin tables": rope, REFERENCE: ft.reference_bytes(s)}
    parts[ep.A2A_BUFFERS] = ep.alltoall_buffers(s, tokens, act_bytes(s))
    if s.pp > 1:
        extra_act, extra_logit, pipe_parts = _pipeline_terms(s, tokens, in_flight, first)
        outside, logit = outside + extra_act, logit + extra_logit
        parts.update(pipe_parts)
    elif s.cp > 1:  # the global-position mask (fitlm.plan.context_parallel); the gathered K/V are activations
        parts.update(cp.parts(s))
    elif s.doc_mask:  # the block-causal mask [B,1,T,T], additive in the attention's dtype, shared by all blocks
        parts["document mask"] = s.rows * s.seq * s.seq * act_bytes(s)  # (fitlm.models.layers.shared_mask)
    sharded = s.dims.fsdp_sharded
    gathered_pb = 2 if s.level == "O2" else param_bytes(s)  # FSDP2 gathers O2's parameters in half
    unsharded = (n - ft.nf4_params(s)) * gathered_pb + ft.nf4_rank_bytes(s, gathered=True)  # NF4: its codes
    staging = 0.0
    if sharded and s.zero == 2:
        # ZeRO-2 keeps the gathered (separate, full) parameters from forward to backward
        parts["ZeRO-2 gathered parameters"] = unsharded
    elif sharded and ft.nf4_params(s):
        # QLoRA peaks in the last block's backward, while it dequantizes: that block gathered, the next one's
        # prefetch not yet issued (measured, MemTracker: one block, its NF4 codes, norms and adapters)
        nf4_block = ft.nf4_params(s) / s.layers
        staging = (layer_params(s) + ft.rank_block_adapters(s) - nf4_block) * gathered_pb + ft.nf4_rank_bytes(
            s, gathered=True
        ) / s.layers
    elif sharded and s.device_kind == "cpu" and not s.cfg.memory.compile:
        # Over gloo each Linear is its own FSDP2 unit (fitlm.parallel.data_parallel): in backward the one computing,
        # the prefetched one's all-gather buffer and its copy-out, at most three of the largest
        staging = 3 * max(i * o for _, i, o in s.counts.linears) / s.tp * gathered_pb
    elif sharded:
        staging = 2 * unsharded / max(1, layers)  # ZeRO-3 in backward: the regathered block and the prefetched next
    # Two candidate moments in backward: the loss (logits alive; measured: no ZeRO-3 block gathered yet)
    # or the first block's backward (logits freed, the head's gradient present, the block gathered or
    # rebuilt by recompute).
    head_grad = s.vocab * s.h * param_bytes(s) / s.tp if has_logits and ft.head_trains(s) else 0.0
    cp_backward = cp.backward_bytes(s)  # context parallel: full-length K/V gradients in a block's backward
    dequant = ft.dequant_bytes(
        s, tokens
    )  # QLoRA: the last block's largest NF4 weight dequantized for its input gradient
    attn_bwd = attention_backward_bytes(s, tokens / s.local_seq)  # memory.attention_backward: matmul
    # It peaks in the last block's attention backward, after that block's MLP backward let go of its saved tensors.
    attn_net = max(0.0, attn_bwd - tokens * s.level_bytes()[3] * s.ffn / s.tp)
    if working + cp_backward + staging + head_grad + dequant + attn_net > outside + logit:
        act, logit, grads_extra = kept + working + cp_backward + dequant + attn_net, 0.0, head_grad
        act_parts[cp.BACKWARD] = cp_backward
        act_parts[ft.DEQUANT] = dequant
        act_parts[ATTN_BACKWARD] = attn_bwd
        if staging:
            parts["ZeRO-3 gathered blocks"] = staging
    else:
        act, grads_extra = kept + outside, 0.0
    # Gradients present during forward: none at accumulation step 1 (zero_grad frees them); with
    # accumulation the earlier micro batches' gradients: unsharded while FSDP2 skips the sync
    # (parallel.gradient_sync: last_micro_batch), their shards when it reduces every micro batch.
    held = trained * gathered_pb if sharded and not s.sync_every else grads_full
    if s.pp > 1:  # one schedule run per step: gradients exist once this stage has run a backward
        grads_fb = held * _backward_before_peak(s, first) + grads_extra
    elif s.dims.ddp:
        # DDP's gradients are views into its buckets, which live for the whole run (zero_grad only drops the
        # views); micro batches that skip the sync accumulate into gradients of their own beside the buckets.
        grads_fb = grads_full + grads_extra
        if s.accum > 1 and not s.sync_every:
            parts["DDP buckets beside unsynced gradients"] = grads_full
    else:
        grads_fb = (0.0 if s.accum == 1 else held) + grads_extra
    nf4_part = ((ft.NF4_PARAMS, int(ft.nf4_rank_bytes(s))),) if params and ft.nf4_params(s) else ()
    fb = _with_parts(params, grads_fb, opt, act, logit, parts, "forward/backward", host + host_act)
    fb = replace(
        fb,
        activation_parts=tuple((k, int(v)) for k, v in act_parts.items() if v),
        host_activations=int(host_act),
        param_parts=nf4_part,
    )
    # Optimizer step: gradients complete (DDP's are views into its buckets: no second copy), plus foreach
    # AdamW's one state-sized temporary (sqrt of v) where sharded DTensors keep it off the fused kernel.
    step_tmp = opt / 2 if not s.offload and foreach_adamw(s) else 0.0
    step_parts = {"RoPE cos/sin tables": rope, REFERENCE: parts[REFERENCE], "optimizer temporaries": step_tmp}
    st = _with_parts(params, grads_full, opt, 0, 0, step_parts, "optimizer step", host + host_act)
    st = replace(st, host_activations=int(host_act), param_parts=nf4_part)  # pinned buffers stay for the next step
    return max((fb, st), key=lambda b: b.total)


def _pipeline_terms(s: Setup, tokens: float, in_flight: float, first: bool) -> tuple[float, float, dict[str, float]]:
    """What a pipeline stage holds beyond its blocks' saved tensors, for chunks of `tokens` tokens: (activations,
    logits, named parts). Counted from torch's schedules (fitlm.plan.simulate runs them):
    - each in-flight chunk's stage output, kept by the schedule until that chunk's backward: the hidden state
      (first stages) or the logits (the last);
    - receive buffers, allocated once for every chunk of the step: activations into every stage but the
      first, gradients into every stage but the last;
    - the first stage's peak falls in its first backward (no logits there): with every in-flight chunk still
      saved, the MLP backward's three [tokens, f] gradients;
    - the last stage's in-flight chunks (GPipe: all of them) each keep the log-softmax their loss saved."""
    hidden = tokens * s.h * residual_bytes(s)  # the residual stream crossing a stage boundary, full width
    chunks = s.step_chunks
    local = 2 if s.schedule == "interleaved_1f1b" else 1  # stages per rank: each in-flight pair keeps an output
    parts = {"pipeline receive buffers": chunks * hidden}  # first: gradients in; last: activations in
    if s.doc_mask:  # per chunk: an additive mask [b, 1, T, T] in the activation dtype, kept for its backward
        parts["document masks (in-flight chunks)"] = in_flight * tokens * s.seq * act_bytes(s)
    if first:
        return local * in_flight * hidden + tokens * 3 * s.ffn * act_bytes(s) / s.tp, 0.0, parts
    held = in_flight if s.schedule == "gpipe" else 1  # the last stage's chunks between forward and backward
    return (local - 1) * in_flight * hidden, tokens * s.vocab / s.tp * (held * act_bytes(s) + (held - 1) * 4), parts


def _backward_before_peak(s: Setup, first: bool) -> float:
    """The share of this stage's gradients that exists when its peak recurs (a backward has run): GPipe peaks at
    its first backward; 1F1B-style schedules in their steady state, which the first stage reaches only with more
    chunks per step than stages, the last from its second chunk on (interleaved: only its last local stage has)."""
    if s.schedule == "gpipe" or (first and s.step_chunks <= s.pp) or s.step_chunks == 1:
        return 0.0
    return 0.5 if s.schedule == "interleaved_1f1b" and not first else 1.0


def _with_parts(
    params: float, grads: float, opt: float, act: float, logit: float, parts: dict[str, float], phase: str, host: float
) -> Breakdown:
    named = tuple((k, int(v)) for k, v in parts.items() if v)
    return Breakdown(
        int(params), int(grads), int(opt), int(act), int(logit), sum(v for _, v in named), phase, int(host), named
    )
