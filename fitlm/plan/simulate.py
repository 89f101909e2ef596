"""The simulate engine: run fitlm's real training step on fake tensors and record peak live bytes.

Why: a closed form is only as good as its author's list of saved tensors. Here nothing is listed:
the model is built by the registry, wrapped by `fitlm.parallel.apply.parallelize` (pipeline stages,
tensor parallel, precision, recompute, chunked loss, DDP/ZeRO/FSDP2) and stepped by the trainer's own
step object (`fitlm.step.train_step.TrainStep`, built by the same `TrainStep.create`; a pipeline runs
torch's own schedule over the step's micro batches), under torch's `FakeTensorMode` (shapes and dtypes,
no storage), while torch's `MemTracker` files every live storage as parameter, gradient, optimizer
state, activation or temporary. A 70B model costs no memory, only Python time per op.

World sizes above one run from this one process on torch's fake process group (fitlm.plan.fake_world:
collectives return at once, shapes are right, and what DDP and pipelining would learn from their peers
is answered as every real rank learns it). The process plays global rank 0; under pipeline parallel it
plays the first replica of every stage in turn (the first stage holds the embedding and the most
in-flight chunks, the last the head and the logits) and reports the most loaded.

Data-dependent scalars (`.item()`, `bool(tensor)`) have no value on fake tensors: `_ScalarStub`
answers them (True for masks, 1 for counts and Adam's step), which never changes a shape; fp16 loss
scaling's overflow check is switched off in the simulation (it unscales gradients in place: no bytes).

DPO: a fake micro batch is 2 × micro_batch_size rows (chosen, then rejected), as the loader yields them; the
policy stands in for the reference's forward (fitlm.step.objectives.objective_for), so a frozen reference copy's
bytes are added here from the analytic count (`fitlm.plan.finetune.reference_bytes`, under `other`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils._python_dispatch import TorchDispatchMode

from fitlm.config import Config
from fitlm.finetune.apply import apply_finetune
from fitlm.memory import nf4
from fitlm.memory.nf4 import is_nf4
from fitlm.memory.precision import half_dtype
from fitlm.memory.tracking import plan_components, track_step
from fitlm.parallel.apply import parallelize
from fitlm.parallel.expert_parallel import simulate_imbalance
from fitlm.plan.fake_world import SimulationUnsupported, answer_ddp, fake_world, peers_answered, pipeline_ranks
from fitlm.plan.finetune import reference_bytes
from fitlm.plan.setup import from_config
from fitlm.registry import build_model
from fitlm.step.train_step import TrainStep

__all__ = ["SimulationUnsupported", "run_step"]


class _ScalarStub(TorchDispatchMode):
    """Answer `.item()` on fake tensors: masks are 'any true', numbers 1 (real tensors keep their values)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def _batch(cfg: Config) -> dict[str, torch.Tensor]:
    setup = from_config(cfg)
    b, t = setup.rows, setup.seq  # DPO: B pairs are 2B rows; GRPO: rows of its longest prompt and completion
    ids = torch.zeros(b, t, dtype=torch.long)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": torch.arange(t).expand(b, t).contiguous(),
        "document_ids": torch.zeros(b, t, dtype=torch.long),
    }


def run_step(cfg: Config, fake: bool = True, imbalance: float = 1.0) -> dict[str, int]:
    """Peak live bytes of a steady training step (after an untracked first step, in which optimizer states
    appear, and a tracked warm-up, as `fitlm profile` measures), by component, on the most loaded rank.

    `fake=False` runs the same thing on real CPU tensors (a cross-check of the harness itself). `imbalance`
    (under expert parallel: fitlm.plan.routing's worst case): the simulated rank's experts receive that many
    times their balanced rows (fitlm.parallel.expert_parallel.simulate_imbalance), capped as routing allows.
    """
    boundary: dict[str, Any] = {}  # what the first pipeline stage sends on, for the later stages' simulations
    peaks = []
    for rank in pipeline_ranks(cfg):
        peak, heavier = _run_rank(cfg, rank, fake, boundary, imbalance)
        peaks.append(peak)
        if heavier is not None:  # ZeRO-1 gives the data-parallel ranks unequal shares: the largest one too
            peaks.append(_run_rank(cfg, heavier, fake, boundary, imbalance)[0])
    return _with_reference(cfg, max(peaks, key=lambda p: p["total"]))


def _with_reference(cfg: Config, peak: dict[str, int]) -> dict[str, int]:
    """The simulated peak plus DPO's frozen reference copy, which the simulation does not build."""
    extra = reference_bytes(from_config(cfg))
    return {**peak, "other": peak["other"] + extra, "total": peak["total"] + extra} if extra else peak


def _heaviest_zero1_rank(optimizer: torch.optim.Optimizer, ctx) -> int | None:
    """The global rank (same pipeline and tensor position) whose ZeRO-1 share of parameters is largest, if not
    this one. ZeroRedundancyOptimizer hands whole parameters to ranks, largest first, each to the least loaded."""
    partition = getattr(optimizer, "_partition_parameters", None)
    if not isinstance(optimizer, ZeroRedundancyOptimizer) or partition is None:
        return None
    sizes = [sum(p.numel() for group in part for p in group["params"]) for part in partition()]
    dp_rank = max(range(len(sizes)), key=sizes.__getitem__)
    # ZeRO-1 shards over the dp x cp ranks (the flattened dp_cp group, cp innermost; a step of its index is tp
    # global ranks)
    own = ctx.dp_rank * ctx.cp + ctx.cp_rank
    return None if sizes[dp_rank] == sizes[own] else ctx.rank + (dp_rank - own) * ctx.tp


def _made_before_tracking(cfg: Config) -> bool:
    """Whether the layout keeps storages for the whole run that are made before a step's tracker starts."""
    d = cfg.parallel.dims
    return d.ddp or d.zero1 or d.pp > 1


def _micro_batches(cfg: Config) -> int:
    accum = cfg.train.gradient_accumulation_steps
    if cfg.parallel.pipeline_parallel > 1:
        return accum  # one schedule run takes all of them: its chunk count (and GPipe's in-flight chunks) follows
    # Two micro batches stand for any accumulation >= 2: from the second on, each meets the same state
    # (the earlier ones' gradients, unsharded or reduced as parallel.gradient_sync says).
    return min(2, accum)


def _run_rank(
    cfg: Config, rank: int, fake: bool, boundary: dict[str, Any], imbalance: float
) -> tuple[dict[str, int], int | None]:
    """The peak of global `rank` (its experts receiving `imbalance` times their balanced rows), and a heavier
    ZeRO-1 rank to run as well (None when there is none)."""
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(fake_world(cfg, rank))
        stack.enter_context(peers_answered(boundary, fake_tensors=fake, pipeline=cfg.parallel.pipeline_parallel > 1))
        if fake:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(_ScalarStub())
        torch.manual_seed(cfg.train.seed)
        # O3 stores half parameters: build them half, since fake parameters cannot be swapped by `.to(half)`
        # later; O3 is then exactly O0 on a half model (no autocast, no FSDP casting policy).
        model = _build_in(cfg, build_model) if fake and cfg.memory.mixed_precision == "O3" else build_model(cfg.model)
        apply_finetune(model, cfg)  # LoRA adapters / frozen layers, as the trainer does before any wrapper
        if fake:
            _nf4_on_fake_device(model)
        if fake and cfg.memory.mixed_precision == "O3":
            _adapters_to_half(model, cfg)
        pm = parallelize(model, _as_built(cfg) if fake else cfg, ctx)
        answer_ddp(pm.modules)
        simulate_imbalance(pm.modules, imbalance)
        train_step = TrainStep.create(cfg, ctx, pm, simulate=fake)  # the trainer's own step, optimizer and all
        batches = [_batch(cfg)] * _micro_batches(cfg)

        def step() -> None:  # every micro batch, synced as the config says (parallel.gradient_sync)
            train_step.forward_backward(batches)
            train_step.optimizer_step()

        step()  # optimizer states appear
        # Then what `fitlm profile` measures. Its burst tracks a warm-up step before the measured one, which meets
        # what lives for the whole run but was made before the tracker (DDP's buckets, ZeRO-1's local optimizer
        # states, a pipeline's receive buffers): the measured step starts with them. Other layouts have none, and
        # are spared that third simulated step.
        peak = track_step(step, pm.modules, train_step.optimizer, warmup_steps=int(_made_before_tracking(cfg))).peak
        heavier = _heaviest_zero1_rank(train_step.optimizer, ctx)
    return plan_components(peak), heavier


def _nf4_on_fake_device(model: torch.nn.Module) -> None:
    """QLoRA's NF4 weights, which `quantize_base` makes on meta for `materialize` to fill, as fake tensors beside
    the rest of the fake model (on meta, every op mixing them with it is a device mismatch): quantized again
    from an empty fake weight, so torchao's dequantization runs under FakeTensorMode as on real tensors. Only the
    weight is replaced (a Linear's fake bias cannot be swapped by `to_empty`), and an MoE layer's stacked experts."""
    for module in model.modules():
        for name, w in list(module._parameters.items()):
            if w is not None and is_nf4(w) and w.is_meta:
                # (scaler_block_size: an attribute of torchao's NF4Tensor, which is_nf4 checked w is)
                fake = nf4.quantized_meta(w, w.scaler_block_size, device="cpu")  # type: ignore[attr-defined]
                setattr(module, name, fake)


def _build_in(cfg: Config, build) -> torch.nn.Module:
    old = torch.get_default_dtype()
    torch.set_default_dtype(half_dtype(cfg.memory))
    try:
        return build(cfg.model)
    finally:
        torch.set_default_dtype(old)


def _adapters_to_half(model: torch.nn.Module, cfg: Config) -> None:
    """O3 casts the whole model, LoRA adapters (made fp32) included; the half-built fake model needs it too."""
    for p in model.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.to(half_dtype(cfg.memory))


def _as_built(cfg: Config) -> Config:
    if cfg.memory.mixed_precision != "O3":
        return cfg
    return cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"mixed_precision": "O0"})})
