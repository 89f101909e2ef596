"""Input health per log interval: how the data-parallel ranks' work compares, and how long the step
waits for its batches.

Per rank and interval: target tokens (positions with a label), padding share (pad positions over all
positions), the longest document seen, and wall seconds per step phase (data, forward, backward,
optimizer, ...). At each log step the ranks gather these (one small collective over the
data-parallel group), and a warning goes to stderr and metrics.jsonl when

- one rank's target tokens or longest document exceed the mean of the other ranks by
  `train.observe.balance_threshold` (the story: one shard full of very long samples, and the ranks that get
  it run out of memory or make every step wait for them);
- the data phase takes more than `train.observe.data_wait_warn` of the step on any rank (the input
  pipeline is the bottleneck).

A warning of one kind is repeated at most every `REPEAT_EVERY` log lines.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from fitlm.models.loss import IGNORE_INDEX

REPEAT_EVERY = 10
DOCS = "docs/troubleshooting.md"
# Per-rank vector: what each slot holds, in order.
TARGETS, POSITIONS, PAD, LONGEST, DATA_S, STEP_S = range(6)


def batch_counts(batch: dict[str, torch.Tensor], pad_id: int) -> tuple[int, int, int, int]:
    """(target tokens, positions, pad positions, longest document) of one micro batch."""
    ids, labels = batch["input_ids"], batch["labels"]
    pad = (ids == pad_id) & (labels == IGNORE_INDEX)
    real = ~pad
    if "position_ids" in batch and bool(real.any()):
        longest = int(batch["position_ids"][real].max()) + 1  # positions restart at 0 per document
    else:
        longest = int(real.sum(dim=1).max()) if real.numel() else 0
    return int((labels != IGNORE_INDEX).sum()), labels.numel(), int(pad.sum()), longest


class InputMonitor:
    def __init__(self, ctx, pad_id: int, balance_threshold: float, wait_threshold: float):
        self.ctx, self.pad_id = ctx, pad_id
        self.balance_threshold, self.wait_threshold = balance_threshold, wait_threshold
        self.logs = 0
        self.last_warned: dict[str, int] = {}
        self._reset()

    def _reset(self) -> None:
        self.counts = [0.0] * 6
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    def observe_batches(self, batches: list[dict[str, torch.Tensor]]) -> None:
        for b in batches:
            targets, positions, pad, longest = batch_counts(b, self.pad_id)
            self.counts[TARGETS] += targets
            self.counts[POSITIONS] += positions
            self.counts[PAD] += pad
            self.counts[LONGEST] = max(self.counts[LONGEST], longest)

    def observe_step(self, seconds: dict[str, float]) -> None:
        self.steps += 1
        for phase, s in seconds.items():
            self.seconds[phase] += s
        self.counts[DATA_S] += seconds.get("data", 0.0)
        self.counts[STEP_S] += sum(seconds.values())

    def summary(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(fields for the step's metrics record, warning records). Collective over the data-parallel group."""
        per_rank = self._gather()
        self.logs += 1
        n = max(1, self.steps)
        fields: dict[str, Any] = {
            "data_wait_share": round(_share(per_rank[0][DATA_S], per_rank[0][STEP_S]), 4),
            "step_seconds": {phase: round(s / n, 6) for phase, s in sorted(self.seconds.items())},
            "target_tokens": [int(r[TARGETS]) for r in per_rank],
            "padding_share": [round(_share(r[PAD], r[POSITIONS]), 4) for r in per_rank],
            "longest_document": [int(r[LONGEST]) for r in per_rank],
        }
        warnings = [w for w in (self._balance_warning(step, per_rank), self._wait_warning(step, per_rank)) if w]
        self._reset()
        return fields, warnings

    def _gather(self) -> list[list[float]]:
        mine = torch.tensor(self.counts, dtype=torch.float64, device=self.ctx.device)
        group = self.ctx.group("dp")
        if group is None or self.ctx.dp == 1:
            return [mine.tolist()]
        out = [torch.empty_like(mine) for _ in range(self.ctx.dp)]
        dist.all_gather(out, mine, group=group)
        return [t.tolist() for t in out]

    def _due(self, kind: str) -> bool:
        last = self.last_warned.get(kind)
        if last is not None and self.logs - last < REPEAT_EVERY:
            return False
        self.last_warned[kind] = self.logs
        return True

    def _balance_warning(self, step: int, per_rank: list[list[float]]) -> dict[str, Any] | None:
        if not self.balance_threshold or len(per_rank) < 2:
            return None
        for slot, what in ((TARGETS, "target tokens"), (LONGEST, "longest document")):
            values = [r[slot] for r in per_rank]
            for rank, v in enumerate(values):
                others = (sum(values) - v) / (len(values) - 1)
                if others > 0 and v / others > self.balance_threshold and self._due("data_balance"):
                    return {
                        "step": step,
                        "warning": "data_balance",
                        "dp_rank": rank,
                        "ratio": round(v / others, 3),
                        "message": f"data-parallel rank {rank} got {v / others:.2f}x the {what} of the other "
                        f"ranks ({int(v)} vs {others:.0f} on average) in the last log interval "
                        f"(train.observe.balance_threshold={self.balance_threshold:g}); see {DOCS}, section "
                        '"One rank runs out of memory (long samples)"',
                    }
        return None

    def _wait_warning(self, step: int, per_rank: list[list[float]]) -> dict[str, Any] | None:
        if not self.wait_threshold:
            return None
        shares = [_share(r[DATA_S], r[STEP_S]) for r in per_rank]
        worst = max(range(len(shares)), key=shares.__getitem__)
        if shares[worst] <= self.wait_threshold or not self._due("data_wait"):
            return None
        return {
            "step": step,
            "warning": "data_wait",
            "dp_rank": worst,
            "ratio": round(shares[worst], 4),
            "message": f"waiting for input batches took {shares[worst]:.0%} of the step time on data-parallel "
            f"rank {worst} (train.observe.data_wait_warn={self.wait_threshold:g}): the input pipeline is the "
            f"bottleneck; raise data.prefetch / data.num_workers. See {DOCS}, section "
            '"Slow input pipeline"',
        }


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0
