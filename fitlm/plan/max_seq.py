"""`fitlm plan --max-seq`: the longest data.seq_length the config's layout fits on the device.

Why a binary search over the analytic plan: every planned byte is non-decreasing in the sequence length
(activations and logits grow with the tokens, masks and gathered K/V with T and T²), so "fits" flips once;
each probe is one closed-form breakdown (microseconds). Lengths are multiples of 2 × context_parallel (the
chunks context parallel balances; 2 without it), up to model.max_seq_len: the RoPE tables and the model's
positions are built for that many, so a longer sequence is a different model. When even model.max_seq_len
fits, the answer says so; raise it (--set model.max_seq_len=N) to search further. A length fits when the
device holds it (usable memory, as the plan's own verdict) and the host holds every rank of a node at load,
step and save (activation offload puts the saved activations there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fitlm.plan.analytic import breakdown
from fitlm.plan.devices import Device
from fitlm.plan.host import SourceTensor, host_peaks
from fitlm.plan.setup import Setup


@dataclass(frozen=True)
class MaxSeq:
    length: int  # the longest fitting length (0: not even one multiple fits)
    multiple: int  # lengths tried are multiples of this (2 × context_parallel)
    limit: int  # model.max_seq_len
    total: int  # per-device bytes at `length`
    next_total: int | None  # per-device bytes at length + multiple (None past the limit)

    @property
    def limited_by(self) -> str:
        return "model.max_seq_len" if self.next_total is None and self.length else "memory"

    def as_dict(self) -> dict[str, Any]:
        if self.length == 0:
            note = (
                f"not even {self.multiple} tokens fit this layout: lower the memory (see the diagnosis) "
                "before lengthening sequences"
            )
        elif self.limited_by == "model.max_seq_len":
            note = (
                f"{self.length} tokens fit, the longest multiple of {self.multiple} within model.max_seq_len="
                f"{self.limit}; raise it (--set model.max_seq_len=N) to search "
                "longer sequences"
            )
        else:
            note = f"{self.length + self.multiple} tokens would need {self.next_total} bytes per device"
        return {
            "length": self.length,
            "multiple_of": self.multiple,
            "limit": self.limit,
            "limited_by": self.limited_by,
            "per_device_total": self.total,
            "next_per_device_total": self.next_total,
            "note": note,
        }


def _fits(s: Setup, dev: Device, source: SourceTensor, seq: int) -> tuple[bool, int]:
    trial = replace(s, seq=seq)
    mem = breakdown(trial)
    return mem.total <= dev.usable_bytes and host_peaks(trial, mem, dev, source).fits, mem.total


def max_seq(s: Setup, dev: Device, source: SourceTensor) -> MaxSeq:
    """The largest multiple of 2 × context_parallel, at most model.max_seq_len, whose plan fits `dev`."""
    step = 2 * s.cp
    lo, hi = 0, s.max_seq_len // step  # in units of `step`: lo fits (0 trivially), the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(s, dev, source, mid * step)[0]:
            lo = mid
        else:
            hi = mid - 1
    length = lo * step
    total = _fits(s, dev, source, length)[1] if length else 0
    after = length + step
    next_total = _fits(s, dev, source, after)[1] if after <= s.max_seq_len else None
    return MaxSeq(length, step, s.max_seq_len, total, next_total)
