"""Rank consistency (`train.observe.consistency_interval`): data-parallel replicas must hold identical weights.

Every N steps each rank computes one checksum per parameter it holds -- the sum of the parameter's
bits read as integers, so it is exact and independent of summation order -- and all ranks gather
them. Ranks that hold the same part of the model (same pipeline stage, same tensor-parallel shard)
but different data-parallel indices must agree bit for bit: with DDP and ZeRO-1 every replica
applies the same averaged gradient to the same weights. When they do not, gradient sync is broken
(or a rank was corrupted) and continuing only trains diverging models, so the run stops with an
error naming the ranks and the first parameter that differs. Every rank reaches the same verdict
because every rank sees every checksum.

Under ZeRO-2/3 (FSDP2) each data-parallel rank holds a different shard by design, so there is no
replica to compare and the check is off.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fitlm.memory.nf4 import is_nf4

DOCS = 'docs/troubleshooting.md, section "Ranks diverge"'
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class RanksDiverged(ValueError):
    """Data-parallel replicas hold different weights."""


def parameter_checksums(modules) -> tuple[list[str], list[int]]:
    """(names, checksums) of every parameter this rank holds (local shards of DTensors)."""
    names, sums = [], []
    for module in modules:
        for name, p in module.named_parameters():
            t = p.detach()
            t = t.to_local() if isinstance(t, DTensor) else t
            if is_nf4(t):  # QLoRA's frozen 4-bit base: quantized from the same weights on every rank
                continue
            names.append(name)
            sums.append(t.contiguous().view(BITS[t.element_size()]).sum(dtype=torch.int64))
    return names, (torch.stack(sums).tolist() if sums else [])


def find_divergence(entries: list[dict]) -> str | None:
    """Given every rank's {rank, group, names, sums}, describe the replicas that disagree, or None."""
    groups: dict[tuple, list[dict]] = {}
    for e in entries:
        groups.setdefault(tuple(e["group"]), []).append(e)
    problems = []
    for members in groups.values():
        votes = Counter(tuple(m["sums"]) for m in members)
        if len(votes) == 1:
            continue
        majority, count = votes.most_common(1)[0]
        if count * 2 > len(members):  # a clear majority: name the ranks outside it
            odd = sorted(m["rank"] for m in members if tuple(m["sums"]) != majority)
            who = f"rank(s) {', '.join(map(str, odd))} differ from the other {count} replica(s)"
        else:
            who = f"ranks {', '.join(str(m['rank']) for m in sorted(members, key=lambda m: m['rank']))} disagree"
        names = members[0]["names"]
        first = next(n for i, n in enumerate(names) if len({m["sums"][i] for m in members}) > 1)
        problems.append(f"{who} (first differing parameter: {first})")
    return "; ".join(problems) or None


class ConsistencyCheck:
    def __init__(self, interval: int, ctx, modules):
        self.ctx, self.modules = ctx, modules
        # Nothing to compare with one replica, and ZeRO-2/3 replicas hold different shards by design.
        self.interval = interval if ctx.distributed and ctx.dims.replicated else 0

    def __call__(self, step: int) -> None:
        """Collective every `interval` steps: raise RanksDiverged on every rank when replicas differ."""
        if not self.interval or step % self.interval:
            return
        names, sums = parameter_checksums(self.modules)
        mine = {"rank": self.ctx.rank, "group": [self.ctx.pp_rank, self.ctx.tp_rank], "names": names, "sums": sums}
        entries: list = [None] * self.ctx.world_size
        dist.all_gather_object(entries, mine)
        problem = find_divergence(entries)
        if problem:
            raise RanksDiverged(
                f"rank consistency check at step {step} (train.observe.consistency_interval={self.interval}): "
                "data-parallel "
                f"replicas that must hold identical weights do not: {problem}. Gradient synchronisation is broken or "
                f"a rank's memory was corrupted; the losses of these ranks no longer describe one model. "
                f"See {DOCS}."
            )
