"""Which config changes a resumed run may make.

A resume continues the *same* training: the network, the data stream and what one optimizer step
learns must not change. Everything else may: optimizer hyper-parameters and the schedule (lower lr
after a spike, more max_steps), logging and evaluation, memory options, and the parallel layout
(checkpoints reshard). The global batch is compared as one number, so trading micro_batch_size for
data_parallel or accumulation is a layout change, not a different run.
"""

from __future__ import annotations

from typing import Any

from fitlm.rules import flatten

# Keys (flattened) whose change makes a different run; prefixes end with ".".
MUST_MATCH = ("model.", "data.", "finetune.", "train.seed")
# init_std/init_from only shape the initial weights, which the checkpoint replaces; the rest only
# change evaluation or how fast batches are read.
MAY_DIFFER = ("model.init_std", "model.init_from", "data.valid", "data.num_workers", "data.prefetch")


def global_batch(cfg: dict[str, Any]) -> int | None:
    t, p = cfg.get("train", {}), cfg.get("parallel", {})
    try:
        return (
            int(t["micro_batch_size"]) * int(t.get("gradient_accumulation_steps", 1)) * int(p.get("data_parallel", 1))
        )
    except (KeyError, TypeError, ValueError):
        return None


def resume_conflicts(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: saved -> now' for every difference that makes `now` a different run than `saved`."""
    a, b = flatten(saved), flatten(now)
    out = []
    for k in sorted(set(a) | set(b)):
        # A key missing on one side did not exist in that fitlm version: its default applied.
        if a.get(k) == b.get(k) or k in MAY_DIFFER or k not in a or k not in b:
            continue
        if any(k == m or (m.endswith(".") and k.startswith(m)) for m in MUST_MATCH):
            out.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    ga, gb = global_batch(saved), global_batch(now)
    if ga is not None and gb is not None and ga != gb:
        out.append(
            f"global batch (train.micro_batch_size × train.gradient_accumulation_steps × "
            f"parallel.data_parallel): {ga} -> {gb}"
        )
    return out
