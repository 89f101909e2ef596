"""Turn one plain model into what this rank runs, in the documented order:

    pipeline split -> tensor parallel -> expert parallel -> context parallel -> precision -> activation recompute
        -> activation offload -> compile
        -> chunked loss -> data parallel / ZeRO (FSDP2 or DDP, with the precision and offload policies)

The model code never changes; each step is a small `apply_*` function from its own module.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fitlm.config import Config
from fitlm.memory.activation_offload import apply_activation_offload
from fitlm.memory.attention_backward import apply_attention_backward
from fitlm.memory.chunked_loss import apply_chunked_loss
from fitlm.memory.compile import apply_compile
from fitlm.memory.precision import apply_precision
from fitlm.memory.recompute import apply_recompute
from fitlm.parallel.data_parallel import apply_data_parallel, set_gradient_sync, sync_gradients, unwrap
from fitlm.parallel.grad_norm import clip_by_norm, clip_each, squared_norm
from fitlm.parallel.mesh import ParallelContext


@dataclass
class ParallelModel:
    """This rank's share of the model and how to run it."""

    ctx: ParallelContext
    modules: list[nn.Module]  # what this rank holds and optimises: the whole model, or its pipeline stages
    pipeline: Any | None = None  # fitlm.parallel.pipeline.Pipeline when pipeline_parallel > 1
    loss_context: Any = field(default=contextlib.nullcontext)  # tensor parallel: loss on vocab-sharded logits
    context_parallel: Any | None = None  # fitlm.parallel.context_parallel.ContextParallel when context_parallel > 1

    @property
    def model(self) -> nn.Module:
        """The single module of a non-pipelined layout (what forward runs)."""
        assert self.pipeline is None and len(self.modules) == 1
        return self.modules[0]

    def gradient_sync(self, enabled: bool) -> None:
        set_gradient_sync(self.modules, enabled)

    def after_eval(self) -> None:
        """A forward without backward leaves ZeRO-2 parameters gathered; free them (FSDP2 reshard)."""
        for module in self.modules:
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    def finish_backward(self) -> None:
        sync_gradients(self.modules, self.ctx)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every rank's share (tensor, pipeline and ZeRO shards), then clip."""
        params = [p for m in self.modules for p in m.parameters() if p.grad is not None]
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(params, max_norm)
        kinds = {p.grad.device_mesh if isinstance(p.grad, DTensor) else None for p in params}
        if len(kinds) > 1:
            # Gradients of several kinds -- expert-parallel experts (DTensors on "ep"), an MoE block's plain
            # parameters under tensor parallel -- beside plain, tensor-parallel or FSDP2 ones: one norm over all,
            # and each gradient scaled on its own (torch's clip cannot mix them in one foreach call).
            norm = squared_norm([cast(torch.Tensor, p.grad) for p in params]).sqrt()
            clip_each(params, max_norm, norm)
            return norm
        if any(isinstance(p.grad, DTensor) for p in params):
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
            return norm.full_tensor() if isinstance(norm, DTensor) else norm
        norm = squared_norm([cast(torch.Tensor, p.grad) for p in params]).sqrt()  # (params: those with a grad)
        clip_by_norm(params, max_norm, norm)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded, HF-named state dict on global rank 0 (None elsewhere). Collective: call on all ranks."""
        if self.pipeline is not None:
            return self.pipeline.gather_full_state_dict()
        module = unwrap(self.model)
        if self.ctx.distributed and any(isinstance(p, DTensor) for p in module.parameters()):
            # Tensor parallel / FSDP shards: gathered; with cpu_offload only rank 0 keeps the result.
            sd = cast(  # (full_state_dict: plain tensors)
                dict[str, torch.Tensor],
                get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
            )
        else:
            sd = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        return sd if self.ctx.is_main else None


def prepares_for_tensor_parallel(cfg: Config) -> bool:
    """Whether `parallelize` runs the family's module surgery (then weights arrive through
    `Family.prepare_state_dict`). LoRA keeps HF's fused names, which its adapters (PEFT format) target,
    except under tensor parallel, which needs the split; there its adapters stay on the Linears the split
    leaves alone (fitlm.finetune.apply.refuse_unshardable_adapters)."""
    return cfg.model.family.prepare_tensor_parallel is not None and (
        not cfg.finetune.adapters or cfg.parallel.tensor_parallel > 1
    )


def parallelize(
    model: nn.Module, cfg: Config, ctx: ParallelContext, materialize: Callable[[list[nn.Module]], None] | None = None
) -> ParallelModel:
    """`materialize(parts)`, for a model built on the meta device: called once, on the parts this rank
    holds, after they are split and sharded (pipeline, tensor parallel, FSDP2) -- so only this rank's
    share is ever allocated -- but before DDP, which starts from real weights."""
    p = cfg.parallel
    prepare = cfg.model.family.prepare_tensor_parallel
    if prepares_for_tensor_parallel(cfg):
        # The module surgery tensor parallel needs (Phi-3 splits its fused projections) happens in every layout,
        # so parameter names -- and checkpoints -- are the same whatever the layout and reshard between them.
        # LoRA without tensor parallel keeps HF's fused names, which its adapters (PEFT format) target.
        prepare(model)
    pipeline = None
    if p.pipeline_parallel > 1:
        from fitlm.parallel.pipeline import Pipeline

        pipeline = Pipeline(model, cfg, ctx)
        stages = pipeline.stage_modules
    else:
        stages = [model]
    loss_context: Callable[..., contextlib.AbstractContextManager] = contextlib.nullcontext
    context_parallel = None
    if p.context_parallel > 1:
        from fitlm.parallel.context_parallel import ContextParallel

        context_parallel = ContextParallel(ctx.group("cp"), p.context_parallel, ctx.cp_rank)
    parts = []
    for stage in stages:
        if p.tensor_parallel > 1:
            from fitlm.parallel.tensor_parallel import apply_tensor_parallel
            from fitlm.parallel.tensor_parallel import loss_context as tp_loss_context

            tp_mesh = cast(DeviceMesh, ctx.submesh("tp"))  # (tensor_parallel > 1: the mesh has a tp dim)
            stage = apply_tensor_parallel(stage, tp_mesh, sequence_parallel=p.sequence_parallel)
            loss_context = lambda stage=stage: tp_loss_context(stage)  # noqa: E731
        if p.expert_parallel > 1:
            from fitlm.parallel.expert_parallel import apply_expert_parallel

            ep_tp = cast(DeviceMesh, ctx.mesh)["ep", "tp"] if p.tensor_parallel > 1 else None  # (ep > 1: a mesh)
            apply_expert_parallel(stage, cast(DeviceMesh, ctx.submesh("ep")), ep_tp)  # (expert_parallel > 1: an ep dim)
        if context_parallel is not None:
            from fitlm.parallel.context_parallel import apply_context_parallel

            apply_context_parallel(stage, context_parallel)
        else:
            apply_attention_backward(stage, cfg.memory.attention_backward)
        # Under FSDP2 (ZeRO-2/3) the sharding owns casting (O2) and offload.
        stage = apply_precision(stage, cfg.memory, sharded=ctx.dims.fsdp_sharded, tensor_parallel=ctx.tp)
        apply_recompute(stage, cfg.memory.recompute, cfg.memory.recompute_every_n_layers)
        apply_activation_offload(stage, cfg.memory.activation_offload, ctx.device)
        apply_compile(stage, cfg.memory, ctx.dims)
        apply_chunked_loss(stage, cfg.memory.loss_chunk_size, compiled=cfg.memory.compile)
        parts.append(stage)
    # DDP starts from real weights (it broadcasts them); FSDP2 shards meta parameters, then they are allocated.
    ddp = ctx.dims.ddp
    if not ddp:
        parts = [apply_data_parallel(stage, ctx, cfg.memory) for stage in parts]
    if materialize is not None:
        materialize(parts)
    if ddp:
        parts = [apply_data_parallel(stage, ctx, cfg.memory) for stage in parts]
    if pipeline is not None:
        pipeline.build_schedule(parts)
    return ParallelModel(ctx, parts, pipeline, loss_context, context_parallel)
