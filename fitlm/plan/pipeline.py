"""Pipeline parallel in the plan: the shape of one stage's peak, and what a stage holds beyond its blocks' saved
tensors. Counted from torch's schedules (fitlm.plan.simulate runs them); one schedule run per optimizer step, so
its chunks are those of every micro batch of the step (`Setup.step_chunks`).
"""

from __future__ import annotations

from fitlm.plan.blocks import mlp_width
from fitlm.plan.setup import Setup, act_bytes, param_bytes, residual_bytes, stage_kinds, stage_range
from fitlm.plan.terms import Feature, Stage, Term

RECEIVE = "pipeline receive buffers"
DOC_MASKS = "document masks (in-flight chunks)"


def shape(s: Setup, first: bool) -> tuple[float, int, float, bool]:
    """(tokens of one chunk, blocks on the stage, chunks alive at the peak, whether the stage computes the loss) of
    the first or the last stage; without pipeline parallel one micro batch of T/C tokens (context parallel), all
    blocks, the loss."""
    if s.pp == 1:
        return s.rows * s.local_seq, s.layers, 1, True
    tokens = s.rows / max(1, s.chunks) * s.seq  # one pipeline chunk
    layers = len(stage_range(s, first)) if s.schedule != "interleaved_1f1b" else 2 * -(-s.layers // (2 * s.pp))
    step_chunks = s.step_chunks  # one schedule run per step: its warm-up counts the chunks of every micro batch
    in_flight: float
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
    return tokens, layers, in_flight, not first


def memory(st: Stage) -> list[Term]:
    """What a stage holds beyond its blocks' saved tensors, for chunks of `st.tokens` tokens:
    - each in-flight chunk's stage output, kept by the schedule until that chunk's backward: the hidden state
      (first stages) or the logits (the last);
    - receive buffers, allocated once for every chunk of the step: activations into every stage but the
      first, gradients into every stage but the last;
    - the first stage's peak falls in its first backward (no logits there): with every in-flight chunk still
      saved, the MLP backward's three [tokens, f] gradients;
    - the last stage's in-flight chunks (GPipe: all of them) each keep the log-softmax their loss saved."""
    s, tokens, in_flight = st.s, st.tokens, st.in_flight
    if s.pp == 1:
        return []
    hidden = tokens * s.h * residual_bytes(s)  # the residual stream crossing a stage boundary, full width
    local = 2 if s.schedule == "interleaved_1f1b" else 1  # stages per rank: each in-flight pair keeps an output
    terms = [Term("other", RECEIVE, s.step_chunks * hidden)]  # first: gradients in; last: activations in
    if s.doc_mask:  # per chunk: an additive mask [b, 1, T, T] in the activation dtype, kept for its backward
        terms.append(Term("other", DOC_MASKS, in_flight * tokens * s.seq * act_bytes(s)))
    if st.first:
        act, logits = local * in_flight * hidden + tokens * 3 * mlp_width(s) * act_bytes(s) / s.tp, 0.0
    else:
        held = in_flight if s.schedule == "gpipe" else 1  # the last stage's chunks between forward and backward
        act = (local - 1) * in_flight * hidden
        logits = tokens * s.vocab / s.tp * (held * act_bytes(s) + (held - 1) * 4)
    return terms + [Term("activations", None, act, "loss"), Term("logits", None, logits, "loss")]


def backward_share(s: Setup, first: bool) -> float:
    """The share of this stage's gradients that exists when its peak recurs (a backward has run): GPipe peaks at
    its first backward; 1F1B-style schedules in their steady state, which the first stage reaches only with more
    chunks per step than stages, the last from its second chunk on (interleaved: only its last local stage has)."""
    if s.schedule == "gpipe" or (first and s.step_chunks <= s.pp) or s.step_chunks == 1:
        return 0.0
    return 0.5 if s.schedule == "interleaved_1f1b" and not first else 1.0


def later_backward(s: Setup, first: bool, in_flight: float) -> bool:
    """Whether a stage whose peak `backward_share` puts in its first backward (no gradient yet, every in-flight
    chunk saved) may peak again in its last one, with every gradient of the step and one chunk left: the first
    stage of a 1F1B schedule that holds more than one chunk (an MoE stage's gradients can outweigh a chunk's
    saved tensors)."""
    return s.pp > 1 and first and s.schedule == "1f1b" and in_flight > 1 and backward_share(s, first) == 0


def accumulation_bytes(s: Setup, first: bool) -> float:
    """A backward that meets the step's gradients adds each new one into its accumulated copy (in place), beside it
    while it does: the stage's largest trained parameter's new gradient (fp32), and at O1/O2 the half product it is
    cast up from. Under full fine-tuning: an MoE stage's stacked experts (E/ep of them), else the largest matrix
    or the vocabulary table the stage holds. Adapters' and frozen models' gradients are small: 0."""
    if s.method != "full":
        return 0.0
    largest = max(
        i * o / (s.ep * s.tp if name.startswith("experts.") else s.tp)
        for n, one in stage_kinds(s, first)
        if n
        for name, i, o in one.counts.linears
    )
    largest = max(largest, s.vocab * s.h / s.tp)  # the embedding (first stage) or the head (last)
    return largest * (param_bytes(s) + (act_bytes(s) if s.level in ("O1", "O2") else 0))


FEATURE = Feature("pipeline parallel", memory=memory)
