"""What `finetune.method` changes in the accounting: which parameters train, what the frozen ones cost,
and which saved tensors a block no longer keeps.

It mirrors fitlm.finetune (apply.py, lora.py, freeze.py), which runs without tensor or pipeline
parallel (preflight refuses those), so everything here is per block of one unsplit model:
  - LoRA adds A [r, in] and B [out, r] per targeted linear (fp32; half at O3); everything else freezes.
  - freeze stops the bottom floor(fraction·L) blocks (and, optionally, the embeddings with a tied head).
  - Frozen parameters get no gradient and no AdamW state; O2 without ZeRO-2/3 stores them in half
    (`stores_frozen_in_half`), so they need no half cast either.
Saved tensors, counted as the analytic engine's BLOCK constants count them (bytes per token): a
norm's normalised input is kept only for its weight's gradient (rb·h); a linear's input only for its
weight's gradient or its adapter's A (O1 keeps one autocast copy per such consumer); a block whose
input needs no gradient (nothing trainable below it) does not keep that input (4h + 4); a block that no
gradient reaches keeps nothing. Each adapter keeps A's output (r per token).
"""

from __future__ import annotations

from fitlm.plan.setup import Setup, embedding_params, head_params, layer_params

ALL_LINEAR = "all-linear"


def linear_shapes(s: Setup) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer LoRA may target in one block, from the family unit."""
    return {name: (i, o) for name, i, o in s.counts.linears}


def lora_targets(s: Setup) -> tuple[str, ...]:
    """The leaf names adapted in every block (targets are matched by leaf name or dotted suffix)."""
    if s.method != "lora":
        return ()
    shapes = linear_shapes(s)
    if ALL_LINEAR in s.lora_targets:
        return tuple(shapes)
    return tuple(n for n in shapes if any(t == n or t.endswith("." + n) for t in s.lora_targets))


def adapter_params(s: Setup) -> int:
    """LoRA parameters of the whole model: r·(in + out) per targeted linear per block."""
    shapes = linear_shapes(s)
    return s.layers * sum(s.lora_r * sum(shapes[n]) for n in lora_targets(s))


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
        return embedding_params(s) + s.layers * layer_params(s) + head_params(s)
    if s.method == "lora":
        return adapter_params(s)
    out = (s.layers - frozen_blocks(s)) * layer_params(s)
    out += embedding_params(s) if embeddings_train(s) else 0
    return out + head_params(s)  # the final norm, and an untied head (a tied one is the embedding, counted above)


def frozen_in_half(s: Setup) -> bool:
    """fitlm.finetune.apply.stores_frozen_in_half: O2 without FSDP2 stores frozen weights in half."""
    return s.method != "full" and s.level == "O2" and not s.dims.fsdp_sharded


def _input_bytes(s: Setup, consumers: int, width: int, casts_per_consumer: bool) -> float:
    """Bytes per token kept for a linear layer input that `consumers` weight gradients or adapters need."""
    if s.level == "O1" and casts_per_consumer:
        return consumers * 2 * width  # autocast makes (and the matmul saves) one half copy per consumer
    return (1 if consumers else 0) * (4 if s.level == "O0" else 2) * width


def _grad_below(s: Setup, block: int) -> bool:
    """Does anything below `block` train (so its input needs a gradient)?"""
    if embeddings_train(s):
        return True
    return block > 0 if s.method == "lora" else block > frozen_blocks(s)


def _block_trains(s: Setup, block: int) -> bool:
    return s.method == "full" or (s.method == "freeze" and block >= frozen_blocks(s))


def block_savings(s: Setup, block: int) -> float:
    """Bytes per token that block `block` keeps less than a fully trained block (negative = more)."""
    if s.method == "full" or not s.counts.finetune_activations:  # parameters and states only, activations as full
        return 0.0
    from fitlm.plan.analytic import block_act_per_token, residual_bytes

    below = _grad_below(s, block)
    input_saving = 0.0 if below else 4 * s.h + 4  # the block input (fp32 for the norm's statistics), rsqrt
    if _block_trains(s, block):
        return input_saving
    if not below and s.method == "freeze":
        return block_act_per_token(s)  # no gradient reaches it: it keeps nothing
    targets = set(lora_targets(s))
    shapes = linear_shapes(s)
    uses = {name: name in targets for name in shapes}  # frozen linears: only adapters consume inputs
    saved = 2 * residual_bytes(s) * s.h  # both norms' weights are frozen: their normalised inputs are not kept
    for group in s.counts.input_groups:  # linears reading one norm output (q/k/v, gate/up)
        saved += _input_bytes(s, len(group), s.h, True) - _input_bytes(s, sum(uses[g] for g in group), s.h, True)
    down = next((n for n, (i, _) in shapes.items() if i == s.ffn and n not in sum(s.counts.input_groups, ())), None)
    if down is not None:  # the MLP's output projection reads the ffn-wide product
        saved += _input_bytes(s, 1, s.ffn, False) - _input_bytes(s, int(uses[down]), s.ffn, False)
    saved -= len(targets) * s.lora_r * (4 if s.level == "O0" else 2)  # each adapter keeps A's output
    return saved + input_saving


def block_cast_params(s: Setup, block: int) -> int:
    """Parameters of block `block` whose half casts its matmuls keep under O1/O2: trainable weights
    and adapters; at O1 also frozen fp32 weights a gradient passes through; frozen half weights never."""
    if _block_trains(s, block):
        return layer_params(s)
    if s.method == "freeze" and not _grad_below(s, block):
        return 0
    adapters = adapter_params(s) // max(1, s.layers)
    return adapters + (layer_params(s) if s.level == "O1" else 0)


def outside_savings(s: Setup) -> float:
    """Bytes per token the final norm keeps less when the head (and the norm) is frozen."""
    if s.method == "full" or not s.counts.finetune_activations:
        return 0.0
    from fitlm.plan.analytic import act_bytes, residual_bytes

    saved = 0.0 if head_trains(s) else act_bytes(s) * s.h  # the head's input, kept for its weight gradient
    if s.method == "lora":
        saved += residual_bytes(s) * s.h  # the final norm's weight is frozen too
    return saved
