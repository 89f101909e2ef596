"""Layout search: every valid layout × memory option for N devices, the fitting ones ranked by tokens/s.

Why exhaustive: the space is small once the model's divisibility rules prune it (tp divides the head
counts, MLP width and vocabulary; pp at most the layers), and each candidate costs a closed-form
evaluation on a frozen `Setup` (microseconds), so 1024 devices finish in seconds. The global batch
(micro_batch_size × data_parallel × accumulation sequences) is held fixed, so every candidate learns
the same thing; when dp does not divide it, the nearest global batch is used and said so. Context parallel
degrees (divisors of N that split data.seq_length into 2C chunks, without pipeline parallel) and activation
offload (on accelerators) are searched too; fitlm.rules checks every candidate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from fitlm import rules
from fitlm.config import Config
from fitlm.parallel.layout import Layout, valid_layouts
from fitlm.parallel_dims import ParallelDims, divisors
from fitlm.plan.analytic import Breakdown, breakdown
from fitlm.plan.devices import Device
from fitlm.plan.features import FEATURES
from fitlm.plan.host import HostPeaks, host_peaks, source_tensor
from fitlm.plan.setup import KNOBS, Setup, from_config, on_device
from fitlm.plan.throughput import Timing, timing

SAFETY = 0.9  # a candidate must leave 10% of the usable memory free (fragmentation, spikes)


@dataclass(frozen=True)
class Candidate:
    setup: Setup
    memory: Breakdown
    timing: Timing
    host: HostPeaks

    def why(self, dev: Device) -> str:
        s, t = self.setup, self.timing
        parts = [f"uses {self.memory.total / dev.usable_bytes:.0%} of usable memory"]
        if t.bubble_s > 0.05 * t.step_s:
            parts.append(f"bubble {t.bubble_s / t.step_s:.0%}")
        comm = t.tp_comm_s + t.dp_comm_s + t.pp_comm_s + sum(v for _, v in t.features)
        parts.append(f"communication {comm / t.step_s:.0%} of the step")
        if s.recompute != "none":
            parts.append(f"{s.recompute} recompute needed to fit")
        if s.cp > 1:
            parts.append(f"each sequence split over {s.cp} ranks")
        if s.offload_mode != "none":
            parts.append(f"activation offload moves {self.memory.host_activations / 2**30:.2f} GiB to the host")
        return "; ".join(parts)


def _layouts(cfg: Config, n: int) -> list[Layout]:
    # The model's own rules (tp divides heads/MLP/vocab; pp <= layers), micro-batch rules checked per candidate.
    trial = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": 1})})
    # cp degrees that split data.seq_length evenly; LoRA and freeze run under every layout, DPO's limits are
    # fitlm.rules' (each candidate is checked against them)
    return valid_layouts(trial, n, context_parallel=True)


STAGES = ("config", "launch")  # fitlm.rules' stages a candidate must pass


def candidates(cfg: Config, n: int, dev: Device, max_micro_batch: int = 64) -> list[Candidate]:
    """Every fitting candidate (within SAFETY of usable device memory, and within the host's RAM), fastest first."""
    base = on_device(from_config(cfg), dev.name)
    # Activation offload moves nothing on a CPU device: the same candidate twice
    act_offloads: tuple[bool, ...] = (False,) if base.device_kind == "cpu" else (False, True)
    # A candidate is a config with another layout: it must not break a rule of fitlm.rules that the
    # config itself keeps (a rule about this machine, e.g. tensorboard missing, is not the layout's doing).
    values = rules.flatten(cfg.model_dump())
    kept = set(rules.ROWS) - set(rules.broken(values, STAGES))
    out: list[Candidate] = []
    limit = dev.usable_bytes * SAFETY
    source = source_tensor(base)  # the largest tensor a load reads: the same for every candidate
    for lay in _layouts(cfg, n):
        per_replica = max(1, round(base.global_batch / lay.dp))
        # Context parallel only at micro batch 1: it splits one sequence, at a K/V gather per layer; more sequences
        # per rank are split by data parallel or accumulation instead, for less traffic and the same activations.
        micro_batches = [1] if lay.cp > 1 else [d for d in divisors(per_replica) if d <= max_micro_batch]
        for mbs in micro_batches:
            axes = [a for f in FEATURES if (a := f.axis(cfg, lay)) is not None]  # e.g. expert parallel's degrees
            for *turned, zero in itertools.product(*(a.values for a in axes), (0, 1, 2, 3)):
                knobs = {a.knob: v for a, v in zip(axes, turned)}
                accum = per_replica // mbs
                options = itertools.product(
                    (False, True) if lay.tp > 1 else (False,),  # sequence parallel
                    _pipeline_options(lay.pp, mbs, base.layers, accum),
                    ("none", "selective", "full"),
                    (0, 4096),
                    (False, True),
                    _sync_options(zero, lay.dp * lay.cp, accum, lay.pp),
                    act_offloads,
                )
                fits_on_device = False  # the same candidate without activation offload (tried first) fits
                for sp, (sched, chunks), recompute, chunk, offload, sync, act_offload in options:
                    # Offload costs copies and host memory for device memory alone: only to fit what does not
                    if (act_offload and fits_on_device) or _refused(
                        values, kept, lay, zero, sp, chunk, offload, act_offload, knobs
                    ):
                        continue
                    s = replace(
                        base,
                        dp=lay.dp,
                        tp=lay.tp,
                        pp=lay.pp,
                        cp=lay.cp,
                        zero=zero,
                        sp=sp,
                        schedule=sched,
                        chunks=chunks,
                        mbs=mbs,
                        accum=accum,
                        recompute=recompute,
                        recompute_every=1,
                        loss_chunk=chunk,
                        offload=offload,
                        gradient_sync=sync,
                        act_offload=act_offload,
                        **knobs,
                    )
                    mem = breakdown(s)
                    fits_on_device = mem.total <= limit
                    if not fits_on_device:
                        continue
                    host = host_peaks(s, mem, dev, source)
                    if host.fits:  # the host must hold every rank of a node at load, step and save too
                        out.append(Candidate(s, mem, timing(s, dev), host))
    out.sort(key=lambda c: (-c.timing.tokens_per_s, c.memory.total))
    return out


def _refused(
    values: dict, kept: set, lay: Layout, zero: int, sp: bool, chunk: int, offload: bool, act_offload: bool, knobs: dict
) -> bool:
    """Whether this candidate breaks a rule (of either stage: a run would start from it) the config keeps."""
    trial = {
        **values,
        "parallel.data_parallel": lay.dp,
        "parallel.tensor_parallel": lay.tp,
        "parallel.pipeline_parallel": lay.pp,
        "parallel.context_parallel": lay.cp,
        "parallel.zero_stage": zero,
        "parallel.sequence_parallel": sp,
        "memory.loss_chunk_size": chunk,
        "memory.cpu_offload": offload,
        "memory.activation_offload": act_offload,
        **{KNOBS[k]: v for k, v in knobs.items()},  # the features' knobs (fitlm.plan.features)
    }
    return any(rule in kept for rule in rules.broken(trial, STAGES))


def _sync_options(zero: int, dp: int, accum: int, pp: int = 1) -> tuple[str, ...]:
    """parallel.gradient_sync choices that differ: only ZeRO-2/3 (over `dp` data x context parallel ranks) with
    accumulation trades memory for traffic, and not under pipeline parallel, which reduces once per step
    whatever the key says (ParallelDims.reduce_every_micro_batch)."""
    if ParallelDims(dp=dp, zero_stage=zero).fsdp_sharded and accum > 1 and pp == 1:
        return ("every_micro_batch", "last_micro_batch")
    return ("auto",)


def _pipeline_options(pp: int, mbs: int, layers: int, accum: int) -> list[tuple[str, int]]:
    # Chunks are counted per step (m × accum share one schedule run), as fitlm.parallel.pipeline checks them.
    if pp == 1:
        return [("1f1b", 1)]
    opts = []
    for m in divisors(mbs):
        if m * accum >= pp:
            opts.append(("1f1b", m))
            if m * accum % pp == 0 and layers >= 2 * pp:
                opts.append(("interleaved_1f1b", m))
    return opts[:4]


def best_per_layout(found: list[Candidate], top: int) -> list[Candidate]:
    """The fastest candidate of each layout (its parallel dimensions and ZeRO stage) so the table shows distinct
    layouts, not variants."""
    seen, out = set(), []
    for c in found:
        key = c.setup.dims
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == top:
            break
    return out
