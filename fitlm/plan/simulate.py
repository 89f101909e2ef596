"""The simulate engine: run fitlm's real training step on fake tensors and record peak live bytes.

Why: a closed form is only as good as its author's list of saved tensors. Here nothing is listed:
the model is built by the registry, wrapped by `fitlm.parallel.apply.parallelize` (tensor parallel,
precision, recompute, chunked loss, DDP/ZeRO/FSDP2) and stepped by `Trainer.forward_backward` and
`Trainer.optimizer_step` themselves, under torch's `FakeTensorMode` (shapes and dtypes, no storage),
while torch's `MemTracker` files every live storage as parameter, gradient, optimizer state,
activation or temporary. A 70B model costs no memory, only Python time per op.

World sizes above one run from this one process on torch's fake process group
(`torch.testing._internal.distributed.fake_pg`): collectives return at once, shapes are right, and
this process plays global rank 0 (the first pipeline stage, the most loaded rank).

Data-dependent scalars (`.item()`, `bool(tensor)`) have no value on fake tensors: `_ScalarStub`
answers them (True for masks, 1 for counts and Adam's step), which never changes a shape; fp16 loss
scaling's overflow check is switched off in the simulation (it unscales gradients in place: no bytes).
Not simulated: pipeline parallel (torch's pipelining schedule needs real point-to-point traffic between
stages) and DDP (ZeRO 0/1 with data parallel: DDP verifies real parameter storage across ranks).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fitlm.config import Config

COMPONENTS = ("params", "grads", "optimizer", "activations", "logits", "other", "total")


class SimulationUnsupported(ValueError):
    """This layout cannot be simulated from one process (the analytic engine still answers)."""


class _ScalarStub(TorchDispatchMode):
    """Answer `.item()` on fake tensors: masks are 'any true', numbers 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_world(cfg: Config):
    """A fake process group and the ("pp","dp","tp") mesh of the layout, as rank 0; torn down after."""
    from fitlm.parallel.mesh import ParallelContext

    p = cfg.parallel
    if p.world_size == 1:
        yield ParallelContext()
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SimulationUnsupported("a process group already exists in this process; simulate in a fresh one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.world_size)
    try:
        mesh = init_device_mesh("cpu", (p.pipeline_parallel, p.data_parallel, p.tensor_parallel),
                                mesh_dim_names=("pp", "dp", "tp"))
        yield ParallelContext(world_size=p.world_size, rank=0, device=torch.device("cpu"), mesh=mesh,
                              dp=p.data_parallel, tp=p.tensor_parallel, pp=p.pipeline_parallel)
    finally:
        dist.destroy_process_group()


def _batch(cfg: Config) -> dict[str, torch.Tensor]:
    b, t = cfg.train.micro_batch_size, cfg.data.seq_length
    ids = torch.zeros(b, t, dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(t).expand(b, t).contiguous(),
            "document_ids": torch.zeros(b, t, dtype=torch.long)}


def run_step(cfg: Config, fake: bool = True) -> dict[str, int]:
    """Peak live bytes of the second training step (optimizer states exist), by component.

    `fake=False` runs the same thing on real CPU tensors (a cross-check of the harness itself).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fitlm.finetune.apply import apply_finetune
    from fitlm.memory.loss_scale import LossScaler
    from fitlm.memory.tracking import tracker_for
    from fitlm.parallel.apply import parallelize
    from fitlm.registry import build_model
    from fitlm.train.optim import build_optimizer
    from fitlm.train.trainer import Trainer

    p = cfg.parallel
    if p.pipeline_parallel > 1:
        raise SimulationUnsupported("pipeline_parallel > 1 is not simulated (torch's pipelining schedule needs real "
                                    "point-to-point traffic); the analytic engine covers it")
    if fake and p.data_parallel > 1 and p.zero_stage <= 1 and p.tensor_parallel == 1:
        raise SimulationUnsupported("data parallel with ZeRO 0/1 is DDP, which checks real parameter storage across "
                                    "ranks and cannot take fake tensors; the analytic engine covers it (a DDP rank "
                                    "holds the single-process peak plus one flat gradient-bucket copy)")
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(_fake_world(cfg))
        if fake:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(_ScalarStub())
        torch.manual_seed(cfg.train.seed)
        # O3 stores half parameters: build them half, since fake parameters cannot be swapped by `.to(half)`
        # later; O3 is then exactly O0 on a half model (no autocast, no FSDP casting policy).
        model = _build_in(cfg, build_model) if fake and cfg.memory.mixed_precision == "O3" else build_model(cfg.model)
        apply_finetune(model, cfg)  # LoRA adapters / frozen layers, as the trainer does before any wrapper
        if fake and cfg.memory.mixed_precision == "O3":
            _adapters_to_half(model, cfg)
        pm = parallelize(model, _as_built(cfg) if fake else cfg, ctx)
        zero1 = ctx.group("dp") if p.zero_stage == 1 and ctx.dp > 1 else None
        sharded = p.zero_stage >= 2 and ctx.dp > 1
        optimizer = build_optimizer(pm.modules, cfg.train, zero1_group=zero1,
                                    host_states=cfg.memory.cpu_offload and not sharded)
        trainer: Any = Trainer.__new__(Trainer)  # the real step methods, without data or an output directory
        trainer.cfg, trainer.ctx, trainer.device, trainer.pm, trainer.optimizer = cfg, ctx, ctx.device, pm, optimizer
        trainer.scaler = LossScaler(cfg.memory, ctx.device)
        trainer.scaler.enabled = trainer.scaler.enabled and not fake  # a fake overflow flag would skip every step
        trainer.timer = lambda phase: contextlib.nullcontext()  # phase wall times mean nothing here
        # Two micro batches stand for any accumulation >= 2: from the second on, each meets the same state
        # (the earlier ones' gradients, unsharded or reduced as parallel.gradient_sync says).
        batches = [_batch(cfg)] * min(2, cfg.train.gradient_accumulation_steps)

        def step() -> None:  # every micro batch, synced as the config says (parallel.gradient_sync)
            trainer.forward_backward(batches)
            trainer.optimizer_step()

        step()  # optimizer states appear
        tracker = tracker_for(pm.modules, optimizer)  # follows the model across its micro-batch calls
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")
    return _by_component(peak)


def _build_in(cfg: Config, build) -> torch.nn.Module:
    from fitlm.memory.precision import half_dtype

    old = torch.get_default_dtype()
    torch.set_default_dtype(half_dtype(cfg.memory))
    try:
        return build(cfg.model)
    finally:
        torch.set_default_dtype(old)


def _adapters_to_half(model: torch.nn.Module, cfg: Config) -> None:
    """O3 casts the whole model, LoRA adapters (made fp32) included; the half-built fake model needs it too."""
    from fitlm.memory.precision import half_dtype

    for p in model.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.to(half_dtype(cfg.memory))


def _as_built(cfg: Config) -> Config:
    if cfg.memory.mixed_precision != "O3":
        return cfg
    return cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"mixed_precision": "O0"})})


def _by_component(peak: dict) -> dict[str, int]:
    """MemTracker's categories -> the plan's components. Logits cannot be told apart from other
    activations by a storage tracker: they are inside `activations` here (and `logits` is 0)."""
    out = {k: 0 for k in COMPONENTS}
    names = {"PARAM": "params", "GRAD": "grads", "OPT": "optimizer", "ACT": "activations", "TEMP": "activations",
             "BUFFER": "other", "OTH": "other"}
    for per_device in peak.values():
        for kind, nbytes in per_device.items():
            key = names.get(str(kind).rsplit(".", 1)[-1])
            if key:
                out[key] += int(nbytes)
            elif kind == "Total":
                out["total"] += int(nbytes)
    return out
