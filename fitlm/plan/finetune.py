"""What `finetune.method` and `finetune.objective` change in the accounting: which parameters train, what
the frozen ones cost, which saved tensors a block no longer keeps, and what DPO and SimPO add.

It mirrors fitlm.finetune (apply.py, lora.py, freeze.py) and fitlm.step.pair_objectives, per block of the model:
  - LoRA adds A [r, in] and B [out, r] per targeted linear (fp32; half at O3); everything else freezes.
    Under tensor parallel each adapter is split with its base (fitlm.parallel.lora_parallel): a
    column-parallel target (q/k/v, gate/up) keeps A whole and B [out/tp, r], r·(in + out/tp) per rank; a
    row-parallel one (o, down) A [r, in/tp] and B whole, r·(in/tp + out). A pipeline stage holds its own
    blocks' adapters.
  - freeze stops the bottom floor(fraction·L) blocks (and, optionally, the embeddings with a tied head);
    under pipeline parallel the first stage holds the frozen blocks, so it trains least.
  - Frozen parameters get no gradient and no AdamW state; O2 stores them in half, ZeRO-2/3's shards too
    (`stores_frozen_in_half`), so they need no half cast either.
  - QLoRA (fitlm.finetune.qlora) is LoRA, with every block Linear (targeted or not) stored as torchao's NF4
    (`nf4.nf4_bytes` each; per ZeRO-2/3 shard when sharded, the stacked experts per expert-parallel rank's E/ep
    too, `nf4.scaler_block` as `quantize_base` picks it; a
    Linear whose shard would split a group stays in the base's storage). An NF4 matmul saves the NF4 weight,
    never a half cast (torchao's LinearNF4), so O1 keeps no cast of those weights; each matmul dequantizes its
    weight in forward and again in backward, whose temporaries (`DEQUANT_BYTES_PER_PARAM`) of the largest
    Linear count once at the backward peak (fitlm.plan.analytic).
Saved tensors, counted as the analytic engine's BLOCK constants count them (bytes per token): a
norm's normalised input is kept only for its weight's gradient (rb·h); a linear's input only for its
weight's gradient or its adapter's A (O1 keeps one autocast copy per such consumer); a block whose
input needs no gradient (nothing trainable below it) does not keep that input (4h + 4); a block that no
gradient reaches keeps nothing. Each adapter keeps A's output (r per token), whole on every tensor-parallel
rank (column-parallel: A is replicated; row-parallel: a partial sum of full width r).

DPO (`finetune.objective: dpo`, fitlm.step.pair_objectives): a micro batch of B pairs is 2B rows (`Setup.rows`), so the
blocks' activations and the logits are those of 2B sequences; the policy's logits always come whole
([2B, T, V], `sequence_logps`: memory.loss_chunk_size does not apply). The reference forward runs first,
under no_grad, and keeps only its [2B] sequence log-probs: its logits and log-softmax are freed before the
policy's forward starts, and they are no larger than the policy's own at its peak, so they add nothing to it.
The reference's weights: under LoRA or QLoRA without `finetune.dpo.reference`, none (the adapters are switched off);
otherwise a whole frozen copy on every rank (not split by tensor or pipeline parallel, not sharded by
ZeRO), in the run's storage precision (fp32 at O0/O1, half at O2/O3), without gradients or optimizer states.
A reference named by `finetune.dpo.reference` is counted as the trained network (it must share its
vocabulary; the planner does not read its directory).

SimPO (`finetune.objective: simpo`) trains on the same pairs, 2B rows with whole logits, but has no
reference: no copy of the weights and no reference forward.

GRPO (`finetune.objective: grpo`) keeps a reference when finetune.grpo.beta > 0: under full fine-tuning the same
frozen copy as DPO's (`reference_bytes`), under LoRA/QLoRA none (the adapters switched off). Its rollout phase
(KV cache, sampling logits, sampling time) is fitlm.plan.grpo's.
"""

from __future__ import annotations

from typing import NamedTuple

from fitlm.memory import nf4
from fitlm.plan.blocks import block_act_per_token
from fitlm.plan.setup import (
    Setup,
    act_bytes,
    block_kinds,
    embedding_params,
    head_params,
    layer_params,
    per_block,
    residual_bytes,
    stage_range,
    total_params,
)
from fitlm.plan.terms import Feature, Stage, Term

ALL_LINEAR = "all-linear"
ADAPTER_METHODS = ("lora", "qlora")  # fitlm.config.FinetuneConfig.adapters
# Peak bytes per weight while torchao dequantizes an NF4 weight (measured with MemTracker, torchao 0.18, any
# input dtype): get_original_weight holds both nibbles' int64 indices (8), their bf16 values (2), the scaled
# halves (2) and the stacked bf16 weight (2) at once; the cast to an fp32 input (O1, O0) comes after they
# are freed and needs less (bf16 + fp32: 6), as does autocast's bf16 copy of it.
DEQUANT_BYTES_PER_PARAM = 14
NF4_PARAMS = "NF4 base linears (4-bit codes + scales)"  # the part of `params` `nf4_rank_bytes` counts
REFERENCE = "reference model (DPO, GRPO; frozen, unsharded)"  # the part of `other` `reference_bytes` counts
DEQUANT = "NF4 dequantization (largest linear)"  # the part of `activations` `dequant_bytes` counts


def adapters(s: Setup) -> bool:
    """LoRA adapters are what trains (`lora`, or `qlora` on its 4-bit base)."""
    return s.method in ADAPTER_METHODS


def linear_shapes(s: Setup) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer LoRA may target in one block, from the family unit."""
    return {name: (i, o) for name, i, o in s.counts.linears}


def lora_targets(s: Setup) -> tuple[str, ...]:
    """The leaf names adapted in every block (targets are matched by leaf name or dotted suffix)."""
    if not adapters(s):
        return ()
    shapes = linear_shapes(s)
    shapes = {n: v for n, v in shapes.items() if n != ROUTER}  # an MoE router stays frozen
    if ALL_LINEAR in s.lora_targets:
        return tuple(shapes)
    leaf = {n: n.rsplit(".", 1)[-1] for n in shapes}  # experts.gate_proj and shared_expert.gate_proj: gate_proj
    return tuple(n for n in shapes if any(t in (n, leaf[n]) or t.endswith("." + n) for t in s.lora_targets))


ROUTER = "gate"  # an MoE block's router in the family's block counts (fitlm.models.counts.moe_block)
EXPERT_INPUT = {"experts.gate_proj": False, "experts.up_proj": False, "experts.down_proj": True}  # E·I on `in`?


def adapter_size(s: Setup, name: str, i: int, o: int, tp: int = 1) -> int:
    """LoRA parameters of one targeted linear, r·(in + out); a stacked expert projection (E·I wide on one side,
    fitlm.finetune.expert_lora) holds one adapter per expert, E·r·(in + out) of one expert's, its I-wide factor
    1/tp of it on a tensor-parallel rank (fitlm.parallel.expert_tensor_parallel)."""
    if name not in EXPERT_INPUT:
        return s.lora_r * (i + o)
    e = s.cfg.model.num_experts or 1
    return e * s.lora_r * ((i // e // tp + o) if EXPERT_INPUT[name] else (i + o // e // tp))


def adapter_params(s: Setup) -> int:
    """LoRA parameters of the whole model: r·(in + out) per targeted linear per block (per expert on experts;
    an MoE model's dense blocks with their own MLP)."""

    def block(one: Setup) -> int:
        shapes = linear_shapes(one)
        return sum(adapter_size(one, n, *shapes[n]) for n in lora_targets(one))

    return round(s.layers * per_block(s, block))


def row_parallel(s: Setup) -> frozenset[str]:
    """Leaf names of the linears tensor parallel splits on `in` (the family's `tp_plan.rowwise`: o, down);
    every other target is column-parallel (split on `out`)."""
    return frozenset(path.rsplit(".", 1)[-1] for path in s.cfg.model.family.tp_plan.rowwise)


def rank_block_adapters(s: Setup) -> float:
    """LoRA parameters of one block on one tensor-parallel rank: r·(in + out/tp) per column-parallel target
    (A [r, in] whole, B [out/tp, r]), r·(in/tp + out) per row-parallel one (A [r, in/tp], B [out, r] whole);
    the adapters of the E/ep experts an expert-parallel rank holds (fitlm.finetune.expert_lora splits them with
    their experts). An MoE model's mean over its routed and dense blocks."""
    return per_block(s, _rank_block_adapters)


def _rank_block_adapters(s: Setup) -> float:
    shapes, rows = linear_shapes(s), row_parallel(s)
    return sum(
        adapter_size(s, n, i, o, s.tp) / s.ep
        if n in EXPERT_INPUT
        else s.lora_r * (i // s.tp + o if n in rows else i + o // s.tp)
        for n in lora_targets(s)
        for i, o in [shapes[n]]
    )


def stage_expert_adapters(s: Setup, first: bool = True) -> float:
    """The part of `stage_trainable` that adapts the E/ep experts a rank of the first or last stage holds (their
    stacked adapters split with them): under expert parallel they are sharded as their experts are, over edp or
    not at all (fitlm.plan.expert_parallel.owned), not over dp as the rest."""
    if not adapters(s):
        return 0.0

    def block(one: Setup) -> float:
        shapes = linear_shapes(one)
        return sum(adapter_size(one, n, *shapes[n], one.tp) / one.ep for n in lora_targets(one) if n in EXPERT_INPUT)

    return len(stage_blocks(s, first)) * per_block(s, block)


def nf4_shards(s: Setup) -> int:
    """The row shards of each NF4 Linear: the ZeRO-2/3 degree (fitlm.finetune.apply), else 1."""
    return s.dims.param_shards


class Nf4Weight(NamedTuple):
    """One block weight QLoRA stores in NF4: (in, out) of the whole weight (a stacked expert projection's E·I wide
    on one side), its double-quantization group, the row blocks ranks hold of it, and those left after FSDP2's
    all-gather (1; under expert parallel each rank's E/ep experts)."""

    i: int
    o: int
    scaler: int
    shards: int
    gathered: int


def nf4_linears(s: Setup, experts: bool | None = None) -> tuple[Nf4Weight, ...]:
    """Each block Linear QLoRA stores in NF4 (none unless qlora), and each stacked expert projection, stored as
    [E·out, in] and split by rows: a Linear's over the ZeRO-2/3 shards, the experts' over expert parallel's ranks
    and under ZeRO-2/3 their replicas (`ParallelDims.expert_param_shards`) when those divide E
    (`nf4.stacked_scaler_block`); as fitlm.finetune.qlora.quantize_base picks them. `experts`: only the stacked
    experts (True), only the rest (False), or all (None)."""
    if s.method != "qlora":
        return ()
    e = s.cfg.model.num_experts or 1
    out = []
    for name, (i, o) in linear_shapes(s).items():
        if experts is not None and (name in EXPERT_INPUT) != experts:
            continue
        if name in EXPERT_INPUT:  # [E, out, in] with E·I on `in` (down) or `out` (gate, up)
            shape = (e, o, i // e) if EXPERT_INPUT[name] else (e, o // e, i)
            shards, gathered = s.dims.expert_param_shards, s.ep
            scaler = nf4.stacked_scaler_block(shape, shards)
        else:
            shards, gathered = nf4_shards(s), 1
            scaler = nf4.scaler_block((o, i), shards)
        if scaler is not None:  # else quantize_base keeps it in the base's storage
            out.append(Nf4Weight(i, o, scaler, shards, gathered))
    return tuple(out)


def nf4_params(s: Setup, experts: bool | None = None) -> int:
    """Parameters of the whole model stored in NF4 (all E experts; QLoRA refuses tensor and pipeline parallel);
    `experts` as `nf4_linears` takes it."""
    return round(s.layers * per_block(s, lambda one: sum(w.i * w.o for w in nf4_linears(one, experts))))


def nf4_rank_bytes(s: Setup, gathered: bool = False, experts: bool | None = None) -> float:
    """Bytes of those NF4 weights on one rank: its rows' shard, or what FSDP2's all-gather of the codes rebuilds
    (`gathered`: the whole weight; each rank's E/ep experts under expert parallel); stacked experts as
    [E·out, in], by rows too. `experts` as `nf4_linears` takes it."""

    def block(one: Setup) -> float:
        return sum(
            nf4.nf4_bytes(w.i * w.o // (w.gathered if gathered else w.shards), w.scaler)
            for w in nf4_linears(one, experts)
        )

    return s.layers * per_block(s, block)


def nf4_split(s: Setup, experts: bool | None = None) -> tuple[float, float]:
    """(NF4 parameters a rank's count holds, their bytes on the rank): the dense part's whole (`experts` False),
    each rank's E/ep experts' (True), or the whole model's (None, without expert parallel), for
    fitlm.plan.analytic.model_states."""
    local = nf4_params(s, experts) / (s.ep if experts else 1)
    return local, nf4_rank_bytes(s, experts=experts)


def dequant_bytes(s: Setup, tokens: float) -> float:
    """What the last block's backward holds beyond its saved tensors while torchao dequantizes a weight for the
    input gradient, at the largest NF4 Linear: the working set, and the gradient of that Linear's output
    [tokens, out] (in the activations' dtype) it is about to multiply. Checked on fake tensors: within 1%
    of the simulated total for q/v and all-linear targets at O0-O2; the other in-flight gradients of that
    moment roughly cancel the saved tensors the block's backward has freed."""
    e = s.cfg.model.num_experts or 1

    def one(i: int, o: int) -> float:  # a stacked expert projection dequantizes one expert at a time
        weights = i * o // e if (i, o) in experts else i * o
        return DEQUANT_BYTES_PER_PARAM * weights + tokens * o * act_bytes(s)

    kinds = [one_s for _, one_s in block_kinds(s)]
    experts = {linear_shapes(k)[n] for k in kinds for n in EXPERT_INPUT if n in linear_shapes(k)}
    return max((one(w.i, w.o) for k in kinds for w in nf4_linears(k)), default=0.0)


def stage_blocks(s: Setup, first: bool) -> range:
    """The blocks on the first or the last pipeline stage (all of them without pipeline parallel)."""
    return stage_range(s, first)


def stage_trainable(s: Setup, first: bool) -> float:
    """Trainable parameters on one rank of the first or last pipeline stage, split by tensor parallel
    (before any ZeRO sharding): adapters by `rank_block_adapters`, matrices by tp."""
    blocks = stage_blocks(s, first)
    if adapters(s):
        return len(blocks) * rank_block_adapters(s)
    out = sum(_block_trains(s, b) for b in blocks) * layer_params(s)
    if first and embeddings_train(s):
        out += embedding_params(s)
    if s.pp == 1 or not first:
        out += head_params(
            s
        )  # the final norm, and an untied head (a tied one is the embedding, as in trainable_params)
    if s.pp > 1 and not first and s.tied and embeddings_train(s):
        out += s.vocab * s.h  # the last stage's copy of a tied embedding is its head, and trains with it
    return out / s.tp


def lora_partial_gradients(s: Setup) -> int:
    """Elements of one block's LoRA gradients that DTensor leaves Partial (a per-rank sum) on a tensor-parallel
    rank: the replicated A [r, in] of every column-parallel target (each rank saw only its output columns)
    and the replicated B [out, r] of every row-parallel one (its input x·Aᵀ is itself a partial sum). Backward
    does not reduce them (checked with CommDebugMode on the fake process group: 0 all-reduces in backward);
    they stay Partial through accumulation and are all-reduced each time the optimizer step reads them
    (`PARTIAL_READS_PER_STEP`)."""
    if s.tp == 1:
        return 0
    shapes, rows = linear_shapes(s), row_parallel(s)
    return sum(s.lora_r * (shapes[n][1] if n in rows else shapes[n][0]) for n in lora_targets(s))


# All-reduces of each Partial gradient per step: foreach AdamW reads it 3 times (6 all-reduces for 2 Partial
# adapter gradients on the fake process group, torch 2.x); clipping reduces only their norms.
PARTIAL_READS_PER_STEP = 3


def dpo(s: Setup) -> bool:
    return s.objective == "dpo"


def grpo_beta(s: Setup) -> bool:
    """GRPO with a KL term (finetune.grpo.beta > 0): it has a reference."""
    return s.objective == "grpo" and s.cfg.finetune.grpo.beta > 0


def reference_copy(s: Setup) -> bool:
    """Does DPO, or GRPO with beta > 0, keep a second, frozen model (not the LoRA base with adapters off)?
    GRPO's reference is always the starting model (fitlm.train.grpo.reference_forward)."""
    if grpo_beta(s):
        return not adapters(s)
    return dpo(s) and not (adapters(s) and s.dpo_reference is None)


def reference_bytes(s: Setup) -> int:
    """The DPO (or GRPO) reference copy on every rank: the whole network, unsplit and unsharded, stored as the run
    stores weights (apply_precision: fp32 at O0/O1, half at O2/O3)."""
    return total_params(s) * (2 if s.level in ("O2", "O3") else 4) if reference_copy(s) else 0


def reference_forward_flops(s: Setup, matmul: int) -> float:
    """FLOPs per row token of the no-grad forwards beside training: DPO's reference, a third of training's 6 per
    matmul parameter and 12·L·h·T attention (the LoRA base: adapters off); GRPO's reference (beta > 0) and old
    policy (num_iterations > 1), once per generation batch, so 1/num_iterations of them per step; 0 for SimPO
    and SFT, which have none."""
    forward = 2.0 * matmul + 4.0 * s.layers * s.h * s.seq
    if s.objective == "grpo":
        g = s.cfg.finetune.grpo
        return forward * (int(g.beta > 0) + int(g.num_iterations > 1)) / g.num_iterations
    return forward if dpo(s) else 0.0


def frozen_blocks(s: Setup) -> int:
    return min(s.layers, int(s.freeze_layers * s.layers + 1e-9)) if s.method == "freeze" else 0


def embeddings_train(s: Setup) -> bool:
    return s.method == "full" or (s.method == "freeze" and not s.freeze_embeddings)


def head_trains(s: Setup) -> bool:
    """The output head (a tied head is the embedding: it freezes with it)."""
    if s.method == "full":
        return True
    return s.method == "freeze" and not (s.tied and s.freeze_embeddings)


def trainable_params(s: Setup) -> int:
    """Parameters that get a gradient and optimizer states (the whole model for `full`)."""
    if s.method == "full":
        return embedding_params(s) + round(s.layers * layer_params(s)) + head_params(s)
    if adapters(s):
        return adapter_params(s)
    out = round((s.layers - frozen_blocks(s)) * layer_params(s))
    out += embedding_params(s) if embeddings_train(s) else 0
    return out + head_params(s)  # the final norm, and an untied head (a tied one is the embedding, counted above)


def frozen_in_half(s: Setup) -> bool:
    """fitlm.finetune.apply.stores_frozen_in_half: O2 stores frozen weights in half, under ZeRO-2/3 too (FSDP2
    gathers a half shard as it is)."""
    return s.method != "full" and s.level == "O2"


def _input_bytes(s: Setup, consumers: int, width: float, casts_per_consumer: bool) -> float:
    """Bytes per token kept for a linear layer input that `consumers` weight gradients or adapters need."""
    if s.level == "O1" and casts_per_consumer:
        return consumers * 2 * width  # autocast makes (and the matmul saves) one half copy per consumer
    return (1 if consumers else 0) * (4 if s.level == "O0" else 2) * width


def _grad_below(s: Setup, block: int) -> bool:
    """Does anything below `block` train (so its input needs a gradient)?"""
    if embeddings_train(s):
        return True
    return block > 0 if adapters(s) else block > frozen_blocks(s)


def _block_trains(s: Setup, block: int) -> bool:
    return s.method == "full" or (s.method == "freeze" and block >= frozen_blocks(s))


def block_savings(s: Setup, block: int) -> float:
    """Bytes per token that block `block` keeps less than a fully trained block (negative = more)."""
    if s.method == "full" or not s.counts.finetune_activations:  # parameters and states only, activations as full
        return 0.0
    below = _grad_below(s, block)
    input_saving = 0.0 if below else 4 * s.h + 4  # the block input (fp32 for the norm's statistics), rsqrt
    if _block_trains(s, block):
        return input_saving
    if not below and s.method == "freeze":
        return block_act_per_token(s)  # no gradient reaches it: it keeps nothing
    targets = set(lora_targets(s))
    shapes = linear_shapes(s)
    uses = {name: name in targets for name in shapes}  # frozen linears: only adapters consume inputs
    width = s.h / (s.tp if s.sp else 1)  # the residual stream: sequence shards under sequence parallel
    saved = 2 * residual_bytes(s) * width  # both norms' weights are frozen: their normalised inputs are not kept
    for group in s.counts.input_groups:  # linears reading one norm output (q/k/v, gate/up)
        saved += _input_bytes(s, len(group), s.h, True) - _input_bytes(s, sum(uses[g] for g in group), s.h, True)
    down = next((n for n, (i, _) in shapes.items() if i == s.ffn and n not in sum(s.counts.input_groups, ())), None)
    if down is not None:  # the MLP's output projection reads the ffn-wide product
        f = s.ffn / s.tp  # row-parallel: each rank reads its [tokens, f/tp] slice
        saved += _input_bytes(s, 1, f, False) - _input_bytes(s, int(uses[down]), f, False)
    saved -= len(targets) * s.lora_r * (4 if s.level == "O0" else 2)  # each adapter keeps A's output
    return saved + input_saving


def block_cast_params(s: Setup, block: int) -> float:
    """Parameters of block `block` on one tensor-parallel rank whose half casts its matmuls keep under O1/O2:
    trainable weights and adapters; at O1 also frozen fp32 weights a gradient passes through (not NF4 ones,
    whose matmul keeps the NF4 weight itself); frozen half weights never."""
    local = layer_params(s) / s.tp
    if _block_trains(s, block):
        return local
    if s.method == "freeze" and not _grad_below(s, block):
        return 0
    return rank_block_adapters(s) + (local - nf4_params(s) / s.layers if s.level == "O1" else 0)


def outside_savings(s: Setup) -> float:
    """Bytes per token the final norm keeps less when the head (and the norm) is frozen."""
    if s.method == "full" or not s.counts.finetune_activations:
        return 0.0
    saved = 0.0 if head_trains(s) else act_bytes(s) * s.h  # the head's input, kept for its weight gradient
    if adapters(s):
        saved += residual_bytes(s) * s.h  # the final norm's weight is frozen too
    return saved


def memory(st: Stage) -> list[Term]:
    """DPO's or GRPO's frozen reference copy (all run), QLoRA's dequantization working set in the last block's
    backward, and its NF4 weights named among the parameters (none where ZeRO's CPU offload holds them)."""
    s = st.s
    terms = [
        Term("other", REFERENCE, reference_bytes(s), "always"),
        Term("activations", DEQUANT, dequant_bytes(s, st.tokens), "backward"),
    ]
    if nf4_params(s) and not (s.offload and s.dims.fsdp_sharded):
        terms.append(Term("params", NF4_PARAMS, 0.0, "always", shown=nf4_rank_bytes(s)))
    return terms


FEATURE = Feature("fine-tuning", memory=memory)
