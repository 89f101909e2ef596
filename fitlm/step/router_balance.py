"""An MoE model's load balancing in the training step (model.moe_balance) and the step's balance metrics.

`aux_loss` (the default), per micro batch, as transformers' `*MoeForCausalLM.forward` computes it: the router
logits of every MoE layer of that forward (kept by fitlm.models.moe.MoEFeedForward in training) give
`load_balancing_loss`, weighted by model.router_aux_loss_coef and added to the micro batch's mean token loss.
fitlm's step divides summed token losses by the whole step's target count, so the term enters as
coef · aux / (micro batches) per micro batch: the step's gradient is that of the mean, over micro batches and
data-parallel ranks, of transformers' loss.

`aux_free` (DeepSeek-V3, arXiv 2412.19437 §2.1.2): no loss term; after each applied optimizer step every MoE
layer's `expert_bias` moves by router_bias_update_rate · sign(mean load − load_e), the load of expert e being the
slots the router chose for it (before any capacity drop) over the step's micro batches on every rank (`reduce`:
the ranks that split the step's tokens), so every rank (data, expert, context parallel) holds the same bias.
A step skipped (fp16 overflow, a guard) leaves the bias. The bias is checkpointed through `state_dict`.

`none`: neither.

Metrics: the logged `loss` stays the token loss (comparable with eval_loss and dense runs); `aux_loss` is the mean
auxiliary loss (unweighted; logged in every mode as a balance measure) and `expert_load` the largest max/mean ratio
of tokens per expert over the MoE layers (1 = perfectly balanced, E/k when every token picks the same k experts);
under aux_free `router_bias_max`, the largest |b_e| over layers and experts (after the step's update), and under
model.capacity_factor `dropped_tokens`, the share of the step's (token, expert) slots dropped by the capacity.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fitlm.models.moe import MoEFeedForward, balance_terms, load_balancing_loss


class RouterBalance:
    def __init__(
        self,
        layers: list[MoEFeedForward],
        top_k: int,
        coef: float,
        reduce,
        mode: str = "aux_loss",
        rate: float = 0.001,
        split: tuple[Callable[[torch.Tensor], torch.Tensor], int] | None = None,
    ):
        self.layers, self.top_k, self.reduce, self.mode, self.rate = layers, top_k, reduce, mode, rate
        # context parallel: (the sum over the cp ranks, their count), which split each micro batch's tokens
        self.split = split
        self.coef = coef if mode == "aux_loss" else 0.0
        self.metrics: dict[str, float] = {}
        self._aux = torch.zeros(2)  # [summed aux loss, micro batches]
        self._counts: torch.Tensor | None = None  # [L, E] tokens per expert, summed over micro batches
        self._dropped: torch.Tensor | None = None  # [dropped slots, routed slots], summed over micro batches
        self._load: torch.Tensor | None = None  # [L, E] the step's counts over every rank (for the bias update)

    @property
    def biased(self) -> bool:
        """Aux-free balancing: the layers hold a routing bias that this object updates and checkpoints."""
        return self.mode == "aux_free"

    def micro_loss(self) -> torch.Tensor | None:
        """coef · aux loss of the micro batch just forwarded (taking the layers' router logits), or None when
        nothing was routed with gradients or no auxiliary loss is added (aux_free, none, coef 0); its value and
        the expert counts are kept for the step's metrics."""
        logits = [m.router_logits for m in self.layers if m.router_logits is not None]
        counts = [m.expert_counts for m in self.layers if m.expert_counts is not None]
        dropped = [m.dropped_slots for m in self.layers if m.dropped_slots is not None]
        for m in self.layers:
            m.router_logits = m.expert_counts = m.dropped_slots = None
        if not logits:
            return None
        aux, value = self._micro_aux(logits)
        self._aux = self._aux.to(aux.device) + torch.stack([value, torch.ones_like(value)])
        stacked = torch.stack(counts).float()  # [L, E]
        self._counts = stacked if self._counts is None else self._counts + stacked
        if dropped:
            d = torch.stack(dropped).sum(dim=0)  # [2]
            self._dropped = d if self._dropped is None else self._dropped + d
        return self.coef * aux if self.coef else None

    def _micro_aux(self, logits: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the term whose gradient this rank adds, the micro batch's aux loss). Under context parallel each cp
        rank holds part of the micro batch's tokens, and the loss is E · sum_e T_e · P_e / R^2 over all of them
        (T, R: slots and rows, P: summed probabilities, the only factor with a gradient). With T and R summed over
        the cp ranks, a rank's own P carries its share of the gradient: E · sum_e T_e · P_e(rank) / R^2, times cp,
        as gradients are averaged over the cp ranks (fitlm.parallel.data_parallel)."""
        if self.split is None:
            aux = load_balancing_loss(logits, self.top_k)
            return aux, aux.detach()
        cp_sum, cp = self.split
        tokens, probs, rows = balance_terms(logits, self.top_k)
        e = tokens.numel()
        summed = cp_sum(torch.cat([tokens, probs.detach(), torch.tensor([float(rows)], device=tokens.device)]))
        t, p, r = summed[:e], summed[e : 2 * e], summed[-1]
        return cp * e * torch.sum(t * probs) / r**2, e * torch.sum(t * p) / r**2

    def observe(self) -> None:
        """After the step's micro batches (collective): its metrics over every rank's micro batches, and the
        loads the bias update of `after_optimizer_step` reads."""
        if self._counts is None:
            return
        aux = self.reduce(self._aux)
        counts = self.reduce(self._counts)  # [L, E]
        load = (counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-9)).max()
        self.metrics = {"aux_loss": float(aux[0] / aux[1].clamp(min=1)), "expert_load": float(load)}
        if self._dropped is not None:
            dropped = self.reduce(self._dropped.to(counts.device))
            self.metrics["dropped_tokens"] = float(dropped[0] / dropped[1].clamp(min=1))
        if self.biased:
            self._load = counts
            self.metrics["router_bias_max"] = self.bias_max()
        self._aux, self._counts, self._dropped = torch.zeros(2), None, None

    def after_optimizer_step(self, applied: bool) -> None:
        """aux_free: b_e += u · sign(mean load − load_e) per layer, from the step's global loads (`observe`);
        nothing when the optimizer step was not applied."""
        load, self._load = self._load, None
        if not self.biased or load is None or not applied:
            return
        with torch.no_grad():
            for layer, row in zip(self.layers, load):
                bias = layer.expert_bias
                assert bias is not None  # (aux_free layers hold one)
                bias.add_(self.rate * torch.sign(row.mean() - row).to(bias.device, bias.dtype))
        self.metrics["router_bias_max"] = self.bias_max()

    def bias_max(self) -> float:
        """The largest |b_e| over the layers (0 without a bias)."""
        biases = [m.expert_bias.abs().max() for m in self.layers if m.expert_bias is not None]
        return float(torch.stack(biases).max()) if biases else 0.0

    # checkpointed beside the loader and the scaler (fitlm.train.trainer's stateful objects)
    def state_dict(self) -> dict[str, Any]:
        """The layers' routing biases [L, E] (aux_free; every rank holds the same, so rank 0's suffices)."""
        if not self.biased:
            return {}
        return {
            "expert_bias": torch.stack(
                [m.expert_bias.detach().float().cpu() for m in self.layers if m.expert_bias is not None]
            )
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bias = state.get("expert_bias")
        if bias is None or not self.biased:
            return
        if tuple(bias.shape) != (len(self.layers), self.layers[0].experts.num_experts):
            raise ValueError(
                f"checkpoint: routing biases of shape {list(bias.shape)} for {len(self.layers)} MoE layers; "
                "resume with the model section the checkpoint was saved with"
            )
        with torch.no_grad():
            for layer, row in zip(self.layers, bias):
                assert layer.expert_bias is not None
                layer.expert_bias.copy_(row.to(layer.expert_bias.device, layer.expert_bias.dtype))
