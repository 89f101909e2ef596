"""Context parallel in the plan: what splitting each sequence over C ranks keeps, moves and costs.

fitlm.parallel.context_parallel runs everything outside attention on this rank's T/C tokens, so the per-token
activations of the analytic engine shrink by C as they are (the engine counts `Setup.local_seq` tokens). What
does not shrink, per attention layer (B micro batch, K kv heads, T the whole sequence, D head dim, e the
activation bytes):
  - the gathered keys and values, [B,K/tp,T,D] each, kept for backward by SDPA in place of the local rotated
    k and v the unsplit block keeps (those are only the gather's input, which its backward does not need):
    2·B·(K/tp)·T·D·e per layer, full T. SDPA's GQA support attends them unexpanded.
  - while a layer gathers, the all-gather's rank-major buffer [C·B,K,T/C,D] beside its [B,K,T,D] reordering
    (one gathered tensor's size, freed at once). That moment is never the peak: the loss, with its logits, comes
    later. In a block's backward, though, the full-length gradients of K and V exist together with the
    reduce-scatter's rank-major copy of one of them: a candidate for the peak once the logits are freed;
  - the masks, built once per micro batch and shared by the layers, in SDPA's additive form and the attention's
    dtype (e; soft-capped eager attention takes bool masks, one byte per entry): plain causal layers attend
    chunk by chunk, each of the rank's two chunks (c = T/2C queries, global index g) only the (g+1)·c keys
    before its end under a [c, (g+1)c] mask, c²·(2C+1) entries whatever the rank; layers with document masks,
    a sliding window or soft-capping take one mask of global positions [T/C,T] ([B,1,T/C,T] with document
    masks) per attention window.
Communication per layer and micro batch: all-gather of K and V in forward, reduce-scatter of their gradients
in backward, and the gathers again when full recompute rebuilds a block; ring costs over the cp group.
"""

from __future__ import annotations

from fitlm.plan.setup import Setup, act_bytes
from fitlm.plan.terms import Feature, Stage, Term, TimeContext, Timed


def local_kv_per_token(s: Setup) -> float:
    """Bytes per local token of the rotated k and v an unsplit block saves, which context parallel replaces by
    the gathered ones (one tensor-parallel rank)."""
    return 2 * act_bytes(s) * s.kv / s.tp if s.cp > 1 else 0.0


def gathered_kv(s: Setup) -> float:
    """Keys and values of the whole sequence one attention layer keeps for backward: 2·B·(K/tp)·T·D·e."""
    return 2 * s.mbs * s.kv / s.tp * s.seq * act_bytes(s) if s.cp > 1 else 0.0


def backward_bytes(s: Setup) -> float:
    """A block's backward: the gradients of its gathered K and V [B,K/tp,T,D] and the reduce-scatter's copy of one."""
    return 1.5 * gathered_kv(s)


def mask_bytes(s: Setup) -> float:
    """The masks of one micro batch (see the module's docstring): the full-attention layers' (chunk prefixes when
    plainly causal, else [T/C,T] of global positions) and, where some layers slide, the window's [T/C,T]."""
    if s.cp == 1:
        return 0.0
    e = 1 if s.softcap else act_bytes(s)
    positions = s.local_seq * s.seq * (s.mbs if s.doc_mask else 1) * e  # one [T/C,T] (or [B,1,T/C,T])
    if s.doc_mask or s.softcap:
        full = positions
    else:
        c = s.seq / (2 * s.cp)
        full = c * c * (2 * s.cp + 1) * e  # the two chunks' [c, (g+1)c] prefixes
    return full + (positions if s.sliding else 0.0)


def gathered_layers(s: Setup, layers: int) -> int:
    """Blocks whose gathered K/V stay from forward to backward: all but those full recompute rebuilds (selective
    recompute keeps the attention inputs)."""
    if s.recompute != "full":
        return layers
    return layers - -(-layers // max(1, s.recompute_every))


# Their names among the activations' parts, and the masks' among `other`
GATHERED = "context parallel: gathered K/V (kept for backward)"
BACKWARD = "context parallel: K/V gradients and reduce-scatter buffer (a block's backward)"
MASK = "context parallel: attention mask"


def memory(st: Stage) -> list[Term]:
    """The gathered K/V among the blocks' saved tensors (the engine counts them with the blocks: they move with
    them under activation offload), the K/V gradients of a block's backward, and the masks (a pipeline stage's
    masks are its in-flight chunks', fitlm.plan.pipeline)."""
    s = st.s
    if s.cp == 1:
        return []
    gathered = st.in_flight * gathered_layers(s, st.layers) * gathered_kv(s)
    terms = [
        Term("activations", GATHERED, 0.0, shown=gathered, in_blocks=True),
        Term("activations", BACKWARD, backward_bytes(s), "backward"),
    ]
    return terms + ([Term("other", MASK, mask_bytes(s))] if s.pp == 1 else [])


def time(tc: TimeContext) -> Timed:
    s = tc.s
    return Timed({"context_parallel_comm": comm_s(s, tc.ring, tc.bandwidth(s.cp, s.tp))})


def comm_s(s: Setup, ring, bandwidth: float) -> float:
    """Seconds per step on the cp group: per layer and micro batch the K and V all-gathers in forward (again
    under full recompute) and their gradients' reduce-scatter in backward. Nothing overlaps them: attention
    waits for its keys."""
    if s.cp == 1:
        return 0.0
    full = s.mbs * s.kv / s.tp * s.seq * act_bytes(s)  # one gathered tensor [B,K/tp,T,D]
    gathers = 2 * (2 if s.recompute == "full" else 1)  # K and V, forward (and rebuilt)
    per_layer = gathers * ring("all_gather", full, s.cp, bandwidth) + 2 * ring("reduce_scatter", full, s.cp, bandwidth)
    return s.accum * s.layers * per_layer


FEATURE = Feature("context parallel", memory=memory, time=time)
