"""The simulate engine: run fitlm's real training step on fake tensors and record peak live bytes.

Why: a closed form is only as good as its author's list of saved tensors. Here nothing is listed:
the model is built by the registry, wrapped by `fitlm.parallel.apply.parallelize` (tensor parallel,
precision, recompute, chunked loss, DDP/ZeRO/FSDP2) and stepped by the trainer's own step object
(`fitlm.step.train_step.TrainStep`, built by the same `TrainStep.create`), under torch's `FakeTensorMode` (shapes and dtypes, no storage),
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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from fitlm.config import Config
from fitlm.finetune.apply import apply_finetune
from fitlm.memory.precision import half_dtype
from fitlm.memory.tracking import peak_by_category, plan_components, tracker_for
from fitlm.parallel.apply import parallelize
from fitlm.parallel.mesh import ParallelContext, context_on_mesh
from fitlm.parallel_dims import MESH_DIMS
from fitlm.registry import build_model
from fitlm.step.train_step import TrainStep


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
    """A fake process group and the mesh of the layout, as rank 0; torn down after."""
    dims = cfg.parallel.dims
    if dims.world_size == 1:
        yield ParallelContext()
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SimulationUnsupported("a process group already exists in this process; simulate in a fresh one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        mesh = init_device_mesh("cpu", dims.mesh_shape, mesh_dim_names=MESH_DIMS)
        yield context_on_mesh(mesh, dims, torch.device("cpu"))
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

    p = cfg.parallel
    if p.pipeline_parallel > 1:
        raise SimulationUnsupported("pipeline_parallel > 1 is not simulated (torch's pipelining schedule needs real "
                                    "point-to-point traffic); the analytic engine covers it")
    if fake and p.dims.ddp:
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
        train_step = TrainStep.create(cfg, ctx, pm, simulate=fake)  # the trainer's own step, optimizer and all
        # Two micro batches stand for any accumulation >= 2: from the second on, each meets the same state
        # (the earlier ones' gradients, unsharded or reduced as parallel.gradient_sync says).
        batches = [_batch(cfg)] * min(2, cfg.train.gradient_accumulation_steps)

        def step() -> None:  # every micro batch, synced as the config says (parallel.gradient_sync)
            train_step.forward_backward(batches)
            train_step.optimizer_step()

        step()  # optimizer states appear
        tracker = tracker_for(pm.modules, train_step.optimizer)  # follows the model across its micro-batch calls
        with tracker:
            step()
        peak = peak_by_category(tracker)
    return plan_components(peak)


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
