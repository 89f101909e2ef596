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
from fitlm.parallel.expert_parallel import expert_parameters
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
    rank_local: list[nn.Parameter] | None = None,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters of `modules` (a model, or this rank's pipeline stages).

    Frozen parameters (requires_grad False) get no optimizer state at all. With `zero1_group`
    (ZeRO-1) each rank of that group keeps the optimizer states of its share only. `host_states`
    (memory.cpu_offload without FSDP) keeps states and an fp32 master copy in host memory. `rank_local`:
    parameters that differ between the ranks of `zero1_group` (expert parallel's experts), stepped by every
    rank's local optimizer with whole states, never broadcast (`_zero1_beside_local`).
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
        return _zero1_beside_local(groups, optimizer_class, zero1_group, set(rank_local or ()), kwargs)
    return optimizer_class(groups, **kwargs)


def _zero1_beside_local(
    groups: list[dict], optimizer_class: type, group: "dist.ProcessGroup", local: set[nn.Parameter], kwargs: dict
) -> torch.optim.Optimizer:
    """ZeRO-1 over `group` for every parameter but `local`, which every rank's local optimizer steps in full.

    Why: torch's ZeroRedundancyOptimizer gives each parameter one owner rank, which steps it and broadcasts the
    result to the group; an expert-parallel expert shard differs from rank to rank of the data-parallel group
    (each ep rank holds other experts), so one owner's broadcast would overwrite the others'. The shards go into
    the local optimizer's groups instead (beside this rank's owned dense parameters, in the group of the same
    weight decay): each rank steps its own experts, and ZeRO broadcasts only what it partitioned. Their states
    stay whole on every rank, as under ZeRO-2/3 with expert parallel; checkpoints name them as any local
    optimizer's states (fitlm.checkpoint.state.local_optimizer)."""
    dense = [{**g, "params": [p for p in g["params"] if p not in local]} for g in groups]
    extra = [[p for p in g["params"] if p in local] for g in groups]
    if not any(g["params"] for g in dense):  # nothing to shard (e.g. LoRA on the experts only)
        return optimizer_class(groups, **kwargs)

    def local_optimizer(owned: list[dict], **kw) -> torch.optim.Optimizer:
        # `owned`: ZeroRedundancyOptimizer's partition for this rank, one entry per group of `dense`, in order
        return optimizer_class([{**g, "params": g["params"] + e} for g, e in zip(owned, extra)], **kw)

    # (ZeroRedundancyOptimizer calls optimizer_class(owned groups, **kwargs): any such callable serves)
    constructor: Any = local_optimizer if local else optimizer_class
    return ZeroRedundancyOptimizer(dense, optimizer_class=constructor, process_group=group, **kwargs)


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Clear the gradients of every parameter `optimizer` steps: under ZeRO-1 with expert parallel the local
    optimizer also steps parameters the wrapper does not list (`_zero1_beside_local`)."""
    optimizer.zero_grad(set_to_none=True)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.optim.zero_grad(set_to_none=True)


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
        rank_local=expert_parameters(modules),
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
