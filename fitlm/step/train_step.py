"""One training step, the same object for the trainer, `fitlm profile` and `fitlm plan --simulate`.

`TrainStep.create(cfg, ctx, pm)` assembles what a step needs from the config: the optimizer (the one
builder, `fitlm.step.optim.optimizer_for`), the loss scaler, the guards and the phase timer. Its two
halves are called by the trainer around its own phases (data loading, out-of-memory diagnosis,
heartbeat): `forward_backward` over the step's micro batches, then `optimizer_step` (unscale, clip,
guards, update). The planner's simulation calls the very same two on fake tensors, so a new piece
of state the step needs cannot be forgotten there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch

from fitlm.config import Config
from fitlm.memory.loss_scale import LossScaler
from fitlm.memory.precision import autocast
from fitlm.models.loss import cross_entropy_sum
from fitlm.parallel.apply import ParallelModel
from fitlm.parallel.mesh import ParallelContext
from fitlm.parallel_dims import WORLD
from fitlm.step.guards import GuardEvent, StepGuards
from fitlm.step.objectives import Objective, objective_for
from fitlm.step.optim import optimizer_for, zero_grad
from fitlm.step.pipeline_balance import PipelineRouterBalance, router_balance
from fitlm.step.timing import PhaseTimer


@dataclass
class StepOutput:
    loss: torch.Tensor  # scalar: token-weighted mean over the global batch (same on every rank)
    grad_norm: torch.Tensor  # scalar: pre-clip global norm; inf when the step overflowed
    skipped: bool  # the optimizer step was not applied (fp16 overflow, or a guard skipped it)
    seconds: dict[str, float]  # wall time per phase: data, forward, backward, optimizer, ...
    guard: GuardEvent | None = None  # what train.observe.guards found in this step (and the action taken)


class _NoTimer:
    """Phase timing where wall times mean nothing (a simulation on fake tensors)."""

    sync: bool  # PhaseTimer's setting (fitlm.profile.burst sets it); never read here

    def __call__(self, phase: str):
        return contextlib.nullcontext()

    def pop(self) -> dict[str, float]:
        return {}


class TrainStep:
    def __init__(
        self,
        cfg: Config,
        ctx: ParallelContext,
        pm: ParallelModel,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        guards: StepGuards,
        timer: PhaseTimer | _NoTimer,
        objective: Objective,
    ):
        self.cfg, self.ctx, self.pm, self.device = cfg, ctx, pm, ctx.device
        self.optimizer, self.scaler, self.guards, self.timer = optimizer, scaler, guards, timer
        self.guard_event: GuardEvent | None = None  # set by optimizer_step
        # finetune.objective (fitlm.step.objectives): what the loss is a mean over, each micro batch's loss, metrics
        self.objective = objective
        # an MoE model's load-balancing loss and expert load (fitlm.step.router_balance); None for a dense model
        self.balance = router_balance(
            cfg,
            pm.modules,
            partial(ctx.all_reduce_sum, dim=ctx.dims.token_dim),
            pipeline=pm.pipeline,
            split=(partial(ctx.all_reduce_sum, dim="cp"), ctx.cp) if ctx.cp > 1 else None,
        )

    @classmethod
    def create(cls, cfg: Config, ctx: ParallelContext, pm: ParallelModel, simulate: bool = False) -> "TrainStep":
        """The step of this config on a parallelized model. `simulate`: on fake tensors, where a loss-scale
        overflow check would read a fake flag (and skip every step) and phase wall times mean nothing."""
        scaler = LossScaler(cfg.memory, ctx.device)
        scaler.enabled = scaler.enabled and not simulate
        return cls(
            cfg,
            ctx,
            pm,
            optimizer_for(cfg, ctx, pm.modules),
            scaler,
            StepGuards(cfg.train.observe.guards, partial(ctx.all_reduce_max, dim=WORLD)),
            _NoTimer() if simulate else PhaseTimer(ctx.device),
            objective_for(cfg, ctx, pm, simulate),
        )

    def document_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-document positions and ids (block-causal attention), when data.document_mask is on."""
        if not self.cfg.data.document_mask:
            return {}
        return {
            "position_ids": batch["position_ids"].to(self.device, non_blocking=True),  # [B, T]
            "document_ids": batch["document_ids"].to(self.device, non_blocking=True),
        }  # [B, T]

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients over micro batches; returns the step's loss.

        The loss is the token-weighted mean over the whole global batch: each micro batch's summed
        loss is divided by the target count of all micro batches on all data-parallel ranks, not
        averaged per micro batch. Data-parallel engines average gradients over ranks, so each rank's
        loss is multiplied by the data-parallel degree to make that average a sum. Under context parallel
        every rank of a "cp" group holds the same batches (counted once, over "dp") and sums the loss of its
        part of each sequence; gradients are averaged over dp x cp ranks, hence that factor.

        The objective (`self.objective`, fitlm.step.objectives) says what is counted (target tokens under SFT,
        pairs under DPO and SimPO) and gives each micro batch's summed loss plus the sums of its logged metrics;
        the loop, the scaling and the reductions are the same for all.
        """
        all_targets = self.ctx.all_reduce_sum(
            torch.tensor(float(sum(self.objective.count(b["labels"]) for b in batches)), device=self.device), "dp"
        )
        n_targets = max(1.0, all_targets.item())
        scale = self.ctx.dims.dp_cp / n_targets * self.scaler.scale  # loss scale: 1 unless fp16
        if self.pm.pipeline is not None:
            sums = self._pipeline_loss_sum(batches, scale).reshape(1)
        else:
            sums = None  # [summed loss, the objective's metric sums...]
            every = self.cfg.parallel.reduce_every_micro_batch  # ZeRO-2/3: keep gradients sharded between micro batches
            for i, batch in enumerate(batches):
                self.pm.gradient_sync(enabled=every or i == len(batches) - 1)
                input_ids, labels, doc, shard = self.model_inputs(batch)
                # loss_context: under tensor parallel the loss (and its backward) runs on vocab-sharded logits.
                with autocast(self.cfg.memory, self.device), self.pm.loss_context(), shard:
                    with self.timer("forward"):
                        loss_sum, extra = self.objective.micro_loss(self, input_ids, labels, doc)
                        aux = self.balance.micro_loss() if self.balance is not None else None
                    with self.timer("backward"):
                        total = loss_sum * scale
                        if aux is not None:  # coef · aux per micro batch: the mean over them (module docstring)
                            total = total + aux * (self.scaler.scale / len(batches))
                        total.backward()
                part = torch.cat([loss_sum.detach().reshape(1), extra])
                sums = part if sums is None else sums + part
        self.pm.finish_backward()
        assert sums is not None  # (a step has at least one micro batch)
        sums = self.ctx.all_reduce_sum(sums, self.ctx.dims.token_dim) / n_targets
        self.objective.observe(sums[1:])
        if self.balance is not None:
            self.balance.observe()
        return sums[0]

    def _pipeline_loss_sum(self, batches: list[dict[str, torch.Tensor]], scale: float) -> torch.Tensor:
        """All of the step's micro batches through ONE pipeline schedule run (it fills and drains once per step,
        not once per micro batch); returns their summed loss on every pp rank.

        Concatenated along the batch dimension, [G·B, T], the schedule cuts them into exactly the chunks G
        separate runs would have made (B / micro_batch_num rows each, in the same order), each divided by the
        same whole-step target count, so losses and gradients are those of G runs. The copy is of integer ids
        only (G·B·T values); activations stay bounded by what the schedule keeps in flight: about pp chunks
        under 1F1B and interleaving, whatever G (GPipe, by its definition, keeps all of the step's chunks).
        The schedule also defers data-parallel gradient reduction (FSDP2) to its last backward, so under
        pipeline parallel gradients are reduced once per step.
        """

        def joined(key: str) -> torch.Tensor:  # [G·B, T]
            return torch.cat([b[key].to(self.device, non_blocking=True) for b in batches])

        doc = {k: joined(k) for k in ("position_ids", "document_ids")} if self.cfg.data.document_mask else {}
        # the timer's phase is forward_backward: the schedule interleaves both over the chunks
        assert self.pm.pipeline is not None  # (called under pipeline parallel only)
        if isinstance(self.balance, PipelineRouterBalance):  # MoE: the aux loss's routing counts first
            with autocast(self.cfg.memory, self.device), self.pm.loss_context(), self.timer("forward"):
                self.balance.begin_step(len(batches), self.scaler.scale, partial(self._pipeline_forward, batches))
        with autocast(self.cfg.memory, self.device), self.pm.loss_context(), self.timer("forward_backward"):
            loss_sum = self.pm.pipeline.step(
                joined("input_ids"), joined("labels"), scale, micro_batches=len(batches), **doc
            )
        return loss_sum.detach()

    def _pipeline_forward(self, batches: list[dict[str, torch.Tensor]], g: int) -> None:
        """Micro batch g through the pipeline, forward only (the MoE balance's counting pass)."""
        assert self.pm.pipeline is not None
        self.pm.pipeline.eval_step(
            batches[g]["input_ids"].to(self.device),
            batches[g]["labels"].to(self.device),
            **self.document_inputs(batches[g]),
        )

    def model_inputs(self, batch: dict[str, torch.Tensor]):
        """(input_ids [B, T], labels [B, T], document kwargs, context) of one micro batch on this device; under
        context parallel this rank's part of each row ([B, T/C], global positions) and the context to run its
        forward and backward in."""
        cp = self.pm.context_parallel
        if cp is not None:
            input_ids, labels, doc, shard = cp.split(batch, self.cfg.data.document_mask, self.device)
            return input_ids, labels, doc, cp.using(shard)
        return (
            batch["input_ids"].to(self.device, non_blocking=True),
            batch["labels"].to(self.device, non_blocking=True),
            self.document_inputs(batch),
            contextlib.nullcontext(),
        )

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor, **doc: torch.Tensor) -> torch.Tensor:
        """Summed token loss of one micro batch through the (non-pipelined) model (the SFT objective's loss)."""
        if self.cfg.memory.loss_chunk_size:
            return self.pm.model(input_ids, labels=labels, **doc)  # chunked head + loss inside forward, no full logits
        return cross_entropy_sum(self.pm.model(input_ids, **doc), labels)  # logits [B, T, V]

    @torch.no_grad()
    def eval_sums(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[summed loss, target count] of one evaluation micro batch (no gradients); under context parallel,
        of this rank's part of it (summed over "dp_cp" by the caller)."""
        input_ids, labels, doc, shard = self.model_inputs(batch)  # [B, T] (or [B, T/C])
        with autocast(self.cfg.memory, self.device), self.pm.loss_context(), shard:
            if self.pm.pipeline is not None:
                loss_sum = self.pm.pipeline.eval_step(input_ids, labels, **doc)
            else:
                loss_sum, _ = self.objective.micro_loss(self, input_ids, labels, doc)
        return torch.stack(
            [
                loss_sum.float().detach().reshape(()),
                torch.tensor(float(self.objective.count(labels)), device=loss_sum.device),
            ]
        )

    def optimizer_step(self, loss: torch.Tensor | None = None, step: int = 0) -> tuple[torch.Tensor, bool]:
        """Unscale (fp16), clip, step, clear; returns the pre-clip global gradient norm and whether the
        step was skipped because a gradient overflowed or, given the step's `loss`, because train.observe.guards
        found it bad (`self.guard_event`); every rank decides the same."""
        params: list[torch.Tensor] = [p for m in self.pm.modules for p in m.parameters() if p.grad is not None]
        overflow = self.scaler.unscale_and_check(params, partial(self.ctx.all_reduce_max, dim=WORLD))
        self.guard_event = None
        if overflow:
            grad_norm = torch.tensor(float("inf"))
        else:
            grad_norm = self.pm.clip_grad_norm(self.cfg.train.grad_clip)
            if loss is not None:
                self.guard_event = self.guards.inspect(step, loss, grad_norm)
            if self.guard_event is None or self.guard_event.applies_update:
                self.optimizer.step()
        applied = not overflow and (self.guard_event is None or self.guard_event.applies_update)
        if self.balance is not None:  # aux_free: the routing bias follows the step's expert loads
            self.balance.after_optimizer_step(applied)
        self.scaler.update(overflow)
        zero_grad(self.optimizer)
        return grad_norm, not applied
