"""An MoE model's load balancing under pipeline parallel: transformers' auxiliary loss, exactly as one process adds it.

One process adds, per micro batch g, coef · aux_g / G with aux_g = E · Σ_e (T_e / R) · (P_e / R) over the router
logits of EVERY MoE layer of that micro batch's forward (fitlm.models.moe.load_balancing_loss): T_e the top-k
slots of expert e, P_e its summed routing probability, R the rows (tokens × MoE layers). Under pipeline parallel
the layers live on different stages and a micro batch reaches them as `micro_batch_num` chunks, and the loss is
not a sum over layers or chunks (T of one layer multiplies P of another), so no stage can compute its share of
it alone. What makes it separable is that only P carries a gradient (top-k does not): the
gradient of aux_g is that of Σ_e c_e · P_e with c_e = E · T_e / R², a constant once T and R are known.

So each step, before the training schedule runs, a forward-only pass of the step's micro batches through the
pipeline (its eval schedule) counts T and R per micro batch on every stage, summed over the pp ranks. In the
training schedule each MoE layer's forward then attaches (`_RouterAuxGrad`) the gradient of
coef · scale / G · Σ_e c_e · P_e to its router logits: the one process's aux gradient, chunk by chunk, stage by
stage. The pass costs one more forward per step; it runs only when the loss is added (moe_balance: aux_loss
with a non-zero coefficient). The logged `aux_loss`, `expert_load` and `dropped_tokens` are the one process's:
T, P and R are summed over the stages after the step (they are sums), the load is the max over every stage's
layers. The routing is the same in the pass and in training (same weights, inputs and chunks).

aux_free: each stage's layers update their biases from their own loads, as RouterBalance does; every rank also
keeps all stages' biases (gathered over pp after each update), since rank 0 writes the checkpoint alone.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, cast

import torch
import torch.distributed as dist

from fitlm.models.moe import MoEFeedForward, moe_layers
from fitlm.step.router_balance import RouterBalance

# Where torch's PipelineStage runs a stage's forward once on uninitialised buffers to learn its shapes before the
# first chunk (torch 2.13: _forward_metadata_inference; 2.4-2.12: _shape_inference): that call is no chunk. Its
# backward (_backward_metadata_inference) reruns a recomputed block's forward, which must match it.
_INFERENCE_FRAMES = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def _shape_inference() -> bool:
    """Whether this forward is torch's shape inference (found on the call stack: it has no flag to read)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _INFERENCE_FRAMES:
            return True
        frame = frame.f_back
    return False


class _RouterAuxGrad(torch.autograd.Function):
    """Identity on a layer's output y whose backward also hands the router logits z [N, E] the gradient of
    Σ_e c_e · Σ_rows softmax(z)_e, i.e. p · (c − p·c) per row. `c` [E] is kept on ctx, not saved: a recompute
    (activation checkpointing) reruns the forward with whatever c, and the backward keeps the first call's."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, logits: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx.c = c
        ctx.save_for_backward(logits)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        p = logits.float().softmax(dim=-1)  # [N, E]
        c = ctx.c.to(p.device)
        dz = p * (c - (p * c).sum(dim=-1, keepdim=True))  # [N, E]
        return grad, dz.to(logits.dtype), None


class PipelineRouterBalance(RouterBalance):
    """RouterBalance for one pp rank's stages (`layers`: its MoE layers, possibly none). Collective over the pp
    group in `begin_step` (with the aux loss) and `observe`, on every pp rank alike."""

    def __init__(
        self,
        stages: list[tuple[int, list[MoEFeedForward]]],
        num_experts: int,
        chunks: int,
        pp_group,
        device,
        capacity: bool,
        **kw,
    ):
        """`stages`: this rank's (stage id, its MoE layers in block order), stage ids ascending."""
        layers = [m for _, ms in stages for m in ms]
        super().__init__(layers, **kw)
        self.num_experts, self.chunks, self.pp_group = num_experts, chunks, pp_group
        self.device, self.capacity = torch.device(device), capacity
        self.index = {id(m): i for i, m in enumerate(layers)}
        self.phase: str | None = None  # "count" in the forward-only pass, "train" in the schedule, else None
        for m in layers:
            m.observer = self.see
        self._reset(1)
        if self.biased:
            everyone = _all_stages(stages, pp_group)
            self.rows = _global_rows(stages, everyone)
            # Every MoE layer's routing bias [L_all, E], on every rank: what the checkpoint (written by rank 0
            # alone) keeps; refreshed after each update
            self.biases = torch.zeros(sum(n for _, n in everyone), num_experts)

    def _reset(self, micro_batches: int) -> None:
        e = self.num_experts
        self.g = 0  # the micro batch the counting pass is in
        self.calls = [0] * len(self.layers)  # training forwards of each layer this step: chunk index
        self.sums = torch.zeros(micro_batches, 2 * e + 1, device=self.device)  # per micro batch [T [E], P [E], R]
        self.pre = torch.zeros(micro_batches, e + 1, device=self.device)  # the counting pass's [T [E], R]
        self.coefs: torch.Tensor | None = None  # [G, E] the c_e of each micro batch, scaled

    def begin_step(self, micro_batches: int, scale: float, forward) -> None:
        """Before the training schedule: reset, and with the aux loss on, count T and R of each micro batch by
        `forward(g)` (micro batch g through the pipeline, no gradients) to fix each one's coefficients."""
        self._reset(micro_batches)
        if not self.coef:
            self.phase = "train"
            return
        self.phase = "count"
        try:
            for g in range(micro_batches):
                self.g = g
                forward(g)
        finally:
            self.phase = None
        pre = self.pre.clone()
        dist.all_reduce(pre, group=self.pp_group)  # every stage's layers: the one process's T and R
        t, rows = pre[:, :-1], pre[:, -1:].clamp(min=1)
        # coef · aux_g · scale / G, aux_g's gradient being Σ_e (E · T_e / R²) · P_e
        self.coefs = self.coef * scale / micro_batches * self.num_experts * t / rows**2  # [G, E]
        self.phase = "train"

    def see(self, layer: MoEFeedForward, logits, counts, dropped, y: torch.Tensor) -> torch.Tensor:
        """The layer's routing of one forward (fitlm.models.moe.MoEFeedForward.observer): counted, and in
        training given the aux loss's gradient."""
        if _shape_inference():
            return y  # a forward on uninitialised buffers, not a chunk
        if self.phase == "count":
            self._add(self.pre, self.g, logits, probs=False)
            return y
        if self.phase != "train" or not torch.is_grad_enabled():
            return y  # evaluation
        i = self.index[id(layer)]
        recompute = torch._C._current_graph_task_id() != -1  # a checkpointed block's forward rerun in backward
        g = min((self.calls[i] - (1 if recompute else 0)) // self.chunks, self.sums.shape[0] - 1)
        if not recompute:
            self.calls[i] += 1
            self._add(self.sums, g, logits, probs=True)
            self._count(i, counts, dropped)
        if self.coefs is None:
            return y
        return _RouterAuxGrad.apply(y, logits, self.coefs[g])

    def _add(self, into: torch.Tensor, g: int, logits: torch.Tensor, probs: bool) -> None:
        """T (top-k slots per expert, as load_balancing_loss counts them), P (summed probabilities) and the
        rows of one layer's logits [N, E] into row g."""
        e = self.num_experts
        with torch.no_grad():
            p = logits.detach().float().softmax(dim=-1)
            chosen = p.topk(self.top_k, dim=-1).indices.reshape(-1)  # [N·k]; a scatter (not bincount): static
            t = torch.zeros(e, device=p.device).scatter_add(0, chosen, torch.ones_like(chosen, dtype=p.dtype))
            parts = [t, p.sum(dim=0)] if probs else [t]
            into[g] += torch.cat([*parts, torch.tensor([float(p.shape[0])], device=p.device)]).to(into.device)

    def _count(self, i: int, counts: torch.Tensor, dropped: torch.Tensor | None) -> None:
        """The dispatched slots per expert of layer i (its load, summed over the step's chunks)."""
        if self._counts is None:
            self._counts = torch.zeros(len(self.layers), self.num_experts, device=counts.device)
        self._counts[i] += counts.float()
        if dropped is not None:
            self._dropped = dropped if self._dropped is None else self._dropped + dropped

    def micro_loss(self) -> torch.Tensor | None:
        return None  # the schedule's layers add the aux gradient themselves (`see`)

    def observe(self) -> None:
        """After the schedule (collective over the token ranks, then over pp): the one process's metrics."""
        e = self.num_experts
        sums = self.sums.clone()
        dist.all_reduce(sums, group=self.pp_group)  # [G, 2E + 1]: T, P, R over every stage's layers
        t, p, rows = sums[:, :e], sums[:, e : 2 * e], sums[:, -1].clamp(min=1)
        aux = e * (t * p).sum(dim=-1) / rows**2  # [G]: load_balancing_loss of each micro batch
        # the ranks of one token group hold the same stages: these reductions match up
        aux_sum = self.reduce(torch.stack([aux.sum(), torch.tensor(float(sums.shape[0]), device=self.device)]))
        counts = self.reduce(self._counts) if self._counts is not None else None  # [L, E]
        dropped = self._dropped.float() if self._dropped is not None else torch.zeros(2, device=self.device)
        dropped = self.reduce(dropped.to(self.device))  # [dropped slots, routed slots]
        load = torch.zeros(1, device=self.device)
        if counts is not None:
            load[0] = (counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-9)).max()
        dist.all_reduce(load, op=dist.ReduceOp.MAX, group=self.pp_group)
        dist.all_reduce(dropped, group=self.pp_group)
        self.metrics = {"aux_loss": float(aux_sum[0] / aux_sum[1].clamp(min=1)), "expert_load": float(load[0])}
        if self.biased:
            self._load = counts  # [L, E] this rank's layers' loads over every token rank: the bias update's
            self.metrics["router_bias_max"] = self.bias_max()
        if self.capacity:
            self.metrics["dropped_tokens"] = float(dropped[0] / dropped[1].clamp(min=1))
        self._aux, self._counts, self._dropped, self.phase = torch.zeros(2), None, None, None

    # ------------------------------------------------------------------ aux_free: the routing biases of all stages

    def after_optimizer_step(self, applied: bool) -> None:
        """The bias update of every local layer (RouterBalance), then every stage's biases gathered (collective
        over pp on every rank: the update is taken or skipped alike everywhere)."""
        super().after_optimizer_step(applied)
        if self.biased:
            local = [
                (row, cast(torch.Tensor, m.expert_bias).detach().float().cpu())
                for row, m in zip(self.rows, self.layers)
            ]
            parts: list = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(parts, local, group=self.pp_group)
            for row, bias in (pair for part in parts for pair in part):
                self.biases[row] = bias
            self.metrics["router_bias_max"] = self.bias_max()

    def bias_max(self) -> float:
        return float(self.biases.abs().max()) if self.biased and self.biases.numel() else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Every stage's routing biases [L_all, E] (kept on every rank: no collective; rank 0 writes them)."""
        return {"expert_bias": self.biases.clone()} if self.biased else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bias = state.get("expert_bias")
        if bias is None or not self.biased:
            return
        if tuple(bias.shape) != tuple(self.biases.shape):
            raise ValueError(
                f"checkpoint: routing biases of shape {list(bias.shape)} for {self.biases.shape[0]} MoE layers; "
                "resume with the model section the checkpoint was saved with"
            )
        self.biases = bias.float().clone()
        with torch.no_grad():
            for row, layer in zip(self.rows, self.layers):
                assert layer.expert_bias is not None
                layer.expert_bias.copy_(self.biases[row].to(layer.expert_bias.device))


def _all_stages(stages: list[tuple[int, list[MoEFeedForward]]], pp_group) -> list[tuple[int, int]]:
    """(stage id, MoE layers) of every stage of every pp rank, stage ids ascending (collective over pp)."""
    parts: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, [(sid, len(ms)) for sid, ms in stages], group=pp_group)
    return sorted(pair for part in parts for pair in part)


def _global_rows(stages: list[tuple[int, list[MoEFeedForward]]], everyone: list[tuple[int, int]]) -> list[int]:
    """The index of each of this rank's MoE layers among all of the model's (stage by stage, in block order)."""
    start, offset = {}, 0
    for sid, n in everyone:
        start[sid], offset = offset, offset + n
    return [start[sid] + i for sid, ms in stages for i in range(len(ms))]


def router_balance(cfg, modules, reduce, pipeline=None, split=None) -> RouterBalance | None:
    """The balance of a model whose `modules` hold MoE layers (None for a dense model). `reduce(t)`: the sum of
    `t` over the ranks that split the step's tokens; `split`: under context parallel, (the sum over the cp
    ranks, cp), the ranks that split each micro batch's tokens (never with pipeline parallel: fitlm.rules).
    `pipeline` (fitlm.parallel.pipeline.Pipeline): the stages' balance, on every pp rank of an MoE model, also
    one whose stages hold no MoE layer."""
    layers = moe_layers(modules)
    m = cfg.model
    kw = dict(
        top_k=m.num_experts_per_tok,
        coef=m.router_aux_loss_coef,
        reduce=reduce,
        mode=m.moe_balance,
        rate=m.router_bias_update_rate,
    )
    if pipeline is not None and m.num_experts:
        return PipelineRouterBalance(
            [(sid, moe_layers([mod])) for sid, mod in pipeline.stages],
            m.num_experts,
            pipeline.chunks,
            pipeline.group,
            pipeline.ctx.device,
            m.capacity_factor is not None,
            **kw,
        )
    return RouterBalance(layers, **kw, split=split) if layers else None
