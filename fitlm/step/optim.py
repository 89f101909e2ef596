"""AdamW with decay/no-decay parameter groups, and the learning-rate schedule as a pure function of the step."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from fitlm.config import Config, TrainConfig
from fitlm.memory.offload import HostAdamW
from fitlm.models.flops import is_embedding
from fitlm.parallel.mesh import ParallelContext


def param_groups(modules: nn.Module | list[nn.Module], weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases and embedding tables do not (decaying them only hurts)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    modules = modules if isinstance(modules, list) else [modules]
    named = [(n, p) for m in modules for n, p in m.named_parameters()]
    for name, p in named:
        if not p.requires_grad or id(p) in seen:  # tied weights appear twice
            continue
        seen.add(id(p))
        # A pipeline's last-stage copy of a tied embedding is an embedding too (no decay).
        tied_copy = getattr(p, "_fitlm_pp_tied_copy", False)
        (decay if p.ndim >= 2 and not is_embedding(name) and not tied_copy else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    modules: nn.Module | list[nn.Module],
    cfg: TrainConfig,
    zero1_group: "dist.ProcessGroup | None" = None,
    host_states: bool = False,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters of `modules` (a model, or this rank's pipeline stages).

    Frozen parameters (requires_grad False) get no optimizer state at all. With `zero1_group`
    (ZeRO-1) each rank of that group keeps the optimizer states of its share only. `host_states`
    (memory.cpu_offload without FSDP) keeps states and an fp32 master copy in host memory.
    """
    groups = [g for g in param_groups(modules, cfg.weight_decay) if g["params"]]
    if not groups:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    optimizer_class: type[torch.optim.AdamW]
    if host_states:
        optimizer_class = HostAdamW
    else:
        optimizer_class = torch.optim.AdamW
        kwargs.update(implementation([p for g in groups for p in g["params"]]))
    if zero1_group is not None:
        return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, process_group=zero1_group, **kwargs)
    return optimizer_class(groups, **kwargs)


def implementation(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's kernel: fused (one pass per tensor, no temporaries) where torch has it for these parameters,
    else foreach (batched, with one state-sized temporary: the planner counts it, fitlm.plan.analytic).

    Fused AdamW exists for CPU and CUDA floating tensors; sharded DTensors (FSDP2, tensor parallel) keep
    foreach, the path torch's FSDP2 and TP are tested with. Parameters of several kinds (expert parallel's
    experts, DTensors on the "ep" mesh, beside plain or FSDP2-sharded ones) take the per-tensor loop: a foreach
    kernel cannot mix plain tensors and DTensors of different meshes."""
    if uses_fused(params):
        return {"fused": True}
    kinds = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
    return {"foreach": len(kinds) == 1}


def uses_fused(params: list[torch.Tensor]) -> bool:
    return all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )


def optimizer_for(cfg: Config, ctx: ParallelContext, modules: list[nn.Module]) -> torch.optim.Optimizer:
    """The optimizer of this config on this rank's (parallelized) modules: ZeRO-1 shards its states over the
    data-parallel group; memory.cpu_offload keeps them on the host unless FSDP2 (ZeRO-2/3) offloads itself."""
    return build_optimizer(
        modules,
        cfg.train,
        zero1_group=ctx.group(ctx.dims.token_dim) if ctx.dims.zero1 else None,
        host_states=cfg.memory.cpu_offload and not ctx.dims.fsdp_sharded,
    )


def scale_for_batch(cfg: TrainConfig, data_parallel: int) -> tuple[TrainConfig, str | None]:
    """Apply train.lr_scaling, and explain what accumulation does to the learning rate.

    Returns the schedule to train with and a note for the user (None when there is nothing to say).
    The heuristic: the gradient noise falls with the batch, so a batch k times larger takes about
    sqrt(k) times the learning rate, with warmup stretched by the same factor to stay stable.
    """
    batch = cfg.micro_batch_size * data_parallel * cfg.gradient_accumulation_steps
    reference = cfg.lr_reference_batch or cfg.micro_batch_size * data_parallel
    if batch == reference:
        return cfg, None
    factor = math.sqrt(batch / reference)
    scaled = cfg.model_copy(
        update={"lr": cfg.lr * factor, "min_lr": cfg.min_lr * factor, "warmup_steps": round(cfg.warmup_steps * factor)}
    )
    what = (
        f"global batch {batch} sequences (micro_batch_size {cfg.micro_batch_size} × data_parallel "
        f"{data_parallel} × gradient_accumulation_steps {cfg.gradient_accumulation_steps}) is {batch / reference:g}× "
        f"the reference batch {reference}"
    )
    if cfg.lr_scaling == "sqrt":
        return scaled, (
            f"{what}: train.lr_scaling=sqrt sets lr {cfg.lr:g} -> {scaled.lr:.4g}, min_lr -> "
            f"{scaled.min_lr:.4g}, warmup_steps {cfg.warmup_steps} -> {scaled.warmup_steps}"
        )
    return cfg, (
        f"{what}; lr {cfg.lr:g} is used unchanged. If lr was tuned for the reference batch, the "
        f"sqrt rule suggests lr {scaled.lr:.4g} and warmup_steps {scaled.warmup_steps}: set "
        "train.lr_scaling=sqrt to apply it (train.lr_reference_batch names the tuned batch)"
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr at max_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "linear":
        frac = 1.0 - progress
    else:
        frac = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * frac


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
