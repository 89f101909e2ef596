"""An MoE model's load balancing in the training step: transformers' auxiliary loss added to each micro
batch's loss, and the step's `aux_loss` and `expert_load` metrics.

Per micro batch, as transformers' `*MoeForCausalLM.forward` computes it: the router logits of every MoE layer
of that forward (kept by fitlm.models.moe.MoEFeedForward in training) give `load_balancing_loss`, weighted by
model.router_aux_loss_coef and added to the micro batch's mean token loss. fitlm's step divides summed token
losses by the whole step's target count, so the term enters as coef · aux / (micro batches) per micro batch:
the step's gradient is that of the mean, over micro batches and data-parallel ranks, of transformers' loss.
The logged `loss` stays the token loss (comparable with eval_loss and dense runs); `aux_loss` is the mean
auxiliary loss (unweighted) and `expert_load` the largest max/mean ratio of tokens per expert over the MoE
layers (1 = perfectly balanced, E/k when every token picks the same k experts).
"""

from __future__ import annotations

import torch

from fitlm.models.moe import MoEFeedForward, load_balancing_loss, moe_layers


class RouterBalance:
    def __init__(self, layers: list[MoEFeedForward], top_k: int, coef: float, reduce):
        self.layers, self.top_k, self.coef, self.reduce = layers, top_k, coef, reduce
        self.metrics: dict[str, float] = {}
        self._aux = torch.zeros(2)  # [summed aux loss, micro batches]
        self._counts: torch.Tensor | None = None  # [L, E] tokens per expert, summed over micro batches

    @classmethod
    def create(cls, cfg, modules, reduce) -> RouterBalance | None:
        """The balance of a model whose `modules` hold MoE layers (None for a dense model). `reduce(t)`: the sum
        of `t` over the ranks that split the step's tokens."""
        layers = moe_layers(modules)
        if not layers:
            return None
        return cls(layers, cfg.model.num_experts_per_tok, cfg.model.router_aux_loss_coef, reduce)

    def micro_loss(self) -> torch.Tensor | None:
        """coef · aux loss of the micro batch just forwarded (taking the layers' router logits), or None when
        nothing was routed with gradients; its value and the expert counts are kept for the step's metrics."""
        logits = [m.router_logits for m in self.layers if m.router_logits is not None]
        counts = [m.expert_counts for m in self.layers if m.expert_counts is not None]
        for m in self.layers:
            m.router_logits = m.expert_counts = None
        if not logits:
            return None
        aux = load_balancing_loss(logits, self.top_k)
        self._aux = self._aux.to(aux.device) + torch.stack([aux.detach(), torch.ones_like(aux)])
        stacked = torch.stack(counts).float()  # [L, E]
        self._counts = stacked if self._counts is None else self._counts + stacked
        return self.coef * aux if self.coef else None

    def observe(self) -> None:
        """After the step's micro batches (collective): its metrics over every rank's micro batches."""
        if self._counts is None:
            return
        aux = self.reduce(self._aux)
        counts = self.reduce(self._counts)  # [L, E]
        load = (counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-9)).max()
        self.metrics = {"aux_loss": float(aux[0] / aux[1].clamp(min=1)), "expert_load": float(load)}
        self._aux, self._counts = torch.zeros(2), None
