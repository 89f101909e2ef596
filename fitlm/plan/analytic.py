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
batch and may keep a frozen reference copy (`other`): see fitlm.plan.finetune. GRPO adds a third peak candidate, its
rollout phase (the KV cache and the sampling logits beside the weights and optimizer states): fitlm.plan.grpo.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitlm.memory.precision import recasts_in_backward
from fitlm.models.matmul_attention import BLOCK_ROWS as ATTN_BLOCK_ROWS
from fitlm.plan import context_parallel as cp
from fitlm.plan import data_parallel, pipeline
from fitlm.plan import finetune as ft
from fitlm.plan.blocks import attention_kept, block_act_per_token, blocked_attention, mlp_width, stage_act_per_token
from fitlm.plan.context_parallel import gathered_layers
from fitlm.plan.features import FEATURES
from fitlm.plan.setup import (
    LEVELS,
    Setup,
    act_bytes,
    embedding_params,
    head_params,
    layer_params,
    param_bytes,
    residual_bytes,
    stage_mean,
    stage_range,
)
from fitlm.plan.terms import Stage, Term, named, only, sum_terms

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
ATTN_BACKWARD = (
    "matmul attention backward (one query block's scores)"  # a part of `activations` (attention_backward_bytes)
)
ATTN_PROBS = (
    "matmul_saved attention probabilities (fp32, kept for backward)"  # a part of `activations` (kept_probabilities)
)


@dataclass(frozen=True)
class Breakdown:
    """Bytes on the most loaded device at its peak; `total` is their sum."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    other: int
    phase: str  # when the peak happens: "forward/backward", "optimizer step" or (GRPO) ROLLOUT
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
        return embedding_params(s) + round(s.layers * layer_params(s)) + head_params(s)
    own = round(len(stage_range(s, first)) * stage_mean(s, first, lambda one: one.counts.block_params))
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


def kept_probabilities(s: Setup, tokens: float, layers: int, in_flight: float) -> float:
    """The part of the kept activations that is matmul_saved's probabilities (all but the blocks full recompute
    rebuilds keep them; selective recompute keeps the score matmuls' outputs, as many bytes)."""
    if blocked_attention(s) != "matmul_saved":
        return 0.0
    keeping = layers - (-(-layers // max(1, s.recompute_every)) if s.recompute == "full" else 0)
    return in_flight * keeping * tokens * attention_kept(s) / s.tp


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
            + e * (2 * s.q + 2 * s.kv + 2 * mlp_width(s)) / t
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
    kept = in_flight * (plain * tokens * stage_act_per_token(s, first) + recomputed * block_act_recompute(s, tokens))
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


def model_states(
    s: Setup, n: float, trained: float | None = None, nf4: tuple[float, float] | None = None
) -> tuple[float, float, float, float]:
    """(params, grads at rest, optimizer, host) bytes for `n` parameters on this rank, `trained` of them
    trainable (default all), per ZeRO stage; `nf4`: (QLoRA's NF4 parameters among the `n`, their bytes on this
    rank), by default the whole model's (`ft.nf4_split`).

    fitlm's levels fix the per-parameter bytes: params and grads in the parameter dtype (fp32, or half
    at O3) and AdamW's two moments in it too; O2's half copies are transient (activations/other).
    Frozen parameters (LoRA, freeze) have neither gradients nor states, and O2 stores them in half; QLoRA's
    NF4 weights hold their 4-bit bytes, per shard as ZeRO-2/3 (and expert parallel) split them.
    """
    pb = param_bytes(s)
    trained = n if trained is None else trained
    frozen_pb = 2 if ft.frozen_in_half(s) else pb
    d = s.dims  # what the ZeRO stage shards (fitlm.parallel_dims.ZERO_STAGES)
    opt_shard = d.shard_factor("optimizer")
    nf4_n, nf4_bytes = ft.nf4_split(s) if nf4 is None else nf4
    frozen = n - trained - nf4_n
    params = (trained * pb + frozen * frozen_pb) / d.shard_factor("params") + nf4_bytes
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
    """One stage's peak: the model's own bytes (states, the blocks' saved tensors, the loss path) plus the terms
    the features add (fitlm.plan.features), at the larger of the forward/backward and the optimizer-step moment."""
    st, states = _stage_shape(s, first)
    params, grads, opt, host = states
    fb, terms, host_act, left = _forward_backward(st, states)
    candidates = [fb]
    if pipeline.later_backward(s, first, st.in_flight):  # its last backward: every gradient, one chunk left
        candidates.append(_forward_backward(replace(st, in_flight=1), states, every_grad=True)[0])
    # Optimizer step: gradients complete (DDP's are views into its buckets: no second copy), plus foreach
    # AdamW's one state-sized temporary (sqrt of v) where sharded DTensors keep it off the fused kernel.
    step_tmp = opt / 2 if not s.offload and foreach_adamw(s) else 0.0
    terms.append(Term("other", "optimizer temporaries", step_tmp, "step"))
    step = _at_moment(params, grads, opt, 0, 0, terms, "step", host, host_act, left)  # pinned buffers stay
    candidates.append(replace(step, phase="optimizer step"))
    if s.objective == "grpo":  # sampling (fitlm.plan.grpo): states as trained, no gradients but DDP's buckets
        act, logit = (sum_terms(terms, "rollout", c) for c in ("activations", "logits"))
        roll = _at_moment(params, grads if s.dims.ddp else 0, opt, act, logit, terms, "rollout", host, 0, 1.0)
        candidates.append(replace(roll, phase=ROLLOUT))
    return max(candidates, key=lambda b: b.total)


def _forward_backward(
    st: Stage, states: tuple[float, float, float, float], every_grad: bool = False
) -> tuple[Breakdown, list[Term], float, float]:
    """The forward/backward peak of a stage (with `every_grad`: at a backward that meets every gradient of the
    step), the terms counted there, and the saved tensors moved to the host and the share left on the device."""
    s, first = st.s, st.first
    params, grads, opt, host = states
    kept, casts, working = activations(s, st.tokens, st.layers, st.in_flight, first)
    outside = st.in_flight * outside_bytes(s, st.tokens) * (1 if st.has_logits else 0.5)
    terms = _model_terms(st) + [t for f in FEATURES for t in f.memory(st)]
    blocks = kept - casts  # the blocks' saved tensors (the half weight casts stay: they are the parameters')
    kept_blocks, host_act = blocks, 0.0
    for f in FEATURES:
        if f.relocate is not None:  # activation offload: saved tensors to the host
            kept_blocks, outside, moved = f.relocate(st, kept_blocks, outside)
            host_act += moved
    left = kept_blocks / blocks if host_act and blocks else 1.0  # of the blocks' saved tensors, on the device
    kept = kept_blocks + casts
    logit = logits_bytes(s, st.tokens) if st.has_logits else 0.0
    # The two forward/backward candidates differ by what exists at one of them only
    moment = "backward" if working + only(terms, "backward") > outside + logit + only(terms, "loss") else "loss"
    at = {c: sum_terms(terms, moment, c) for c in COMPONENTS}
    if moment == "loss":
        act, logit = kept + outside + at["activations"], logit + at["logits"]
    else:
        act, logit = kept + working + at["activations"], 0.0
    held, dp_terms = data_parallel.forward_grads(st, grads)
    terms += dp_terms
    if every_grad:  # every gradient of the step, and one more being added into its accumulated copy
        held, act = grads, act + pipeline.accumulation_bytes(s, first)
    fb = _at_moment(params, held + at["grads"], opt, act, logit, terms, moment, host, host_act, left)
    return replace(fb, phase="forward/backward"), terms, host_act, left


ROLLOUT = "rollout (sampling)"  # GRPO's peak phase when sampling holds more than the step


COMPONENTS = ("params", "grads", "optimizer", "activations", "logits", "other")


def _stage_shape(s: Setup, first: bool) -> tuple[Stage, tuple[float, float, float, float]]:
    """The stage (fitlm.plan.pipeline's shape) and its model states: the parameters the engine counts, sharded by
    ZeRO, plus those a feature counts itself (expert parallel's experts)."""
    n = rank_params(s, first)
    trained = n if s.method == "full" else ft.stage_trainable(s, first)
    owned = [o for f in FEATURES if (o := f.owned(s, first)) is not None]
    n -= sum(o.dense for o in owned)
    trained -= sum(o.dense_trained for o in owned)
    # QLoRA's 4-bit experts, when a feature counts the experts itself (expert parallel), are its own
    params, grads, opt, host = model_states(s, n, trained, ft.nf4_split(s, experts=False) if owned else None)
    for o in owned:
        p, g, m, h = model_states(o.as_setup, o.n, o.trained, o.nf4)
        params, grads, opt, host = params + p, grads + g, opt + m, host + h
    tokens, layers, in_flight, has_logits = pipeline.shape(s, first)
    return Stage(s, first, tokens, layers, in_flight, has_logits, n, trained), (params, grads, opt, host)


def _model_terms(st: Stage) -> list[Term]:
    """The model's own named terms: its RoPE tables (buffers), the document mask, the loss's head gradient in
    backward, and memory.attention_backward's blocked matmul attention (its kept probabilities, its backward)."""
    s, tokens = st.s, st.tokens
    rope = s.counts.rope_tables * 2 * s.max_seq_len * s.head_dim * 4  # RoPE cos/sin tables (buffers)
    terms = [Term("other", "RoPE cos/sin tables", rope, "always")]
    if s.doc_mask and s.pp == 1 and s.cp == 1:  # the block-causal mask [B,1,T,T], additive in the attention's
        # dtype, shared by all blocks (fitlm.models.layers.shared_mask); pipeline and context parallel keep their own
        terms.append(Term("other", "document mask", s.rows * s.seq * s.seq * act_bytes(s)))
    # The backward moment: logits freed, the head's gradient present
    head_grad = s.vocab * s.h * param_bytes(s) / s.tp if st.has_logits and ft.head_trains(s) else 0.0
    attn_bwd = attention_backward_bytes(s, tokens / s.local_seq)  # memory.attention_backward: matmul
    # It peaks in the last block's attention backward, after that block's MLP backward let go of its saved tensors.
    attn_net = max(0.0, attn_bwd - tokens * s.level_bytes()[3] * s.ffn / s.tp)
    return terms + [
        Term("activations", ATTN_PROBS, 0.0, shown=kept_probabilities(s, tokens, st.layers, st.in_flight)),
        Term("grads", None, head_grad, "backward"),
        Term("activations", ATTN_BACKWARD, attn_net, "backward", shown=attn_bwd),
    ]


def _at_moment(
    params: float,
    grads: float,
    opt: float,
    act: float,
    logit: float,
    terms: list[Term],
    moment: str,
    host: float,
    host_act: float,
    left: float,
) -> Breakdown:
    """A Breakdown at `moment` of the model's bytes and the terms' `other` and named parts; `host` the model
    states' host bytes (offload), `host_act` the saved tensors there, `left` their share left on the device."""
    other = named(terms, moment, "other")
    listed = tuple((k, int(v)) for k, v in other.items() if v)
    counted = sum_terms([t for t in terms if t.name is None], moment, "other")
    return Breakdown(
        int(params),
        int(grads),
        int(opt),
        int(act),
        int(logit),
        sum(v for _, v in listed) + int(counted),
        moment,
        int(host + host_act),
        listed,
        activation_parts=tuple((k, int(v)) for k, v in named(terms, moment, "activations", left).items() if v),
        host_activations=int(host_act),
        param_parts=tuple((k, int(v)) for k, v in named(terms, moment, "params").items() if v),
    )
