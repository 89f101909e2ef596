"""Mixture-of-experts feed-forward: a top-k router, stacked experts and dropless dispatch, as transformers
computes Qwen3-MoE, Qwen2-MoE and Mixtral.

Shape letters: N tokens of the call (B·T flattened), H model width, E routed experts, k experts per token,
I expert width. The experts are stacked tensors ([E, I, H] and [E, H, I], fitlm.models.experts), not E
modules: one parameter per projection, so a sharding or an expert-parallel split cuts the leading dimension,
and a grouped matmul can take them whole. The router runs in fp32 whatever the precision level (autocast off),
then softmax, top-k and, where the family does, renormalization of the k weights.

Training forwards keep their router logits (`router_logits`, fp32 [N, E]) and tokens per expert
(`expert_counts`, [E]) for fitlm.step.router_balance, which adds transformers' load-balancing loss
(`load_balancing_loss`) and logs the expert load.

Balancing (model.moe_balance): `aux_loss` (transformers' auxiliary loss, the default), `aux_free` (DeepSeek-V3's
auxiliary-loss-free balancing: a per-expert bias `expert_bias` [E] is added to the routing probabilities to pick
the top-k only; the weights that multiply the experts' outputs are the unbiased probabilities; the bias is
moved by fitlm.step.router_balance after each optimizer step) or `none`.

Capacity (model.capacity_factor, null = dropless): each expert takes at most C = ceil(capacity_factor · N · k / E)
of the N·k slots of one MoE layer's forward, the earliest tokens first; the others are dropped (they add 0 to
their token, which keeps its other experts and the residual). N is the forward's tokens on one rank (micro
batch × its sequence part), or, under expert parallel, on the ep group's ranks together (`kept_slots`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from fitlm.models.experts import GroupedExperts
from fitlm.models.layers import GatedMLP


def slot_counts(flat: torch.Tensor, e: int) -> tuple[torch.Tensor, list[int]]:
    """Slots per expert of the flat expert ids [N·k]: (counts [E], the same as ints). On fake tensors (the
    planner's simulation: no values to route by) the planner's balanced routing, the slots split evenly."""
    if is_fake(flat):
        m = flat.shape[0]
        split = [m // e + (i < m % e) for i in range(e)]
        return torch.tensor(split, device=flat.device), split
    counts = torch.bincount(flat, minlength=e)  # [E]
    return counts, counts.tolist()


def capacity(capacity_factor: float, slots: int, e: int) -> int:
    """Slots one expert takes of `slots` (N·k) routed ones: ceil(capacity_factor · N · k / E)."""
    return math.ceil(capacity_factor * slots / e)


def capacity_kept(counts: torch.Tensor, capacity_factor: float) -> torch.Tensor:
    """Slots kept of counts [S, E] (the slots S sources send each expert, sources in token order): each expert
    keeps its first C = ceil(capacity_factor · all slots / E), the earlier sources' before the later ones'."""
    c = capacity(capacity_factor, int(counts.sum()), counts.shape[-1])
    before = counts.cumsum(0) - counts  # slots of the earlier sources, per expert
    return (c - before).clamp(min=0).minimum(counts)


def kept_slots(counts: torch.Tensor, split: list[int], capacity_factor: float) -> list[int]:
    """The slots per expert a forward keeps under a capacity (one process: its own N·k slots)."""
    if is_fake(counts):  # the planner's even split, computed without values
        c = capacity(capacity_factor, sum(split), len(split))
        return [min(n, c) for n in split]
    return capacity_kept(counts.reshape(1, -1), capacity_factor)[0].tolist()


def first_slots(split: list[int], kept: list[int], device) -> torch.Tensor:
    """Indices of the first kept[e] of each expert's split[e] (expert-sorted) slots."""
    starts = [0]
    for n in split[:-1]:
        starts.append(starts[-1] + n)
    parts = [torch.arange(s, s + c, device=device) for s, c in zip(starts, kept) if c]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def dispatch(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts_of: torch.Tensor,
    experts: GroupedExperts,
    kept: list[int] | None = None,
):
    """Token-choice dispatch: x [N, H], weights / experts_of [N, k] -> (sum_k w · expert(x) [N, H],
    slots routed to each expert [E]).

    The N·k (token, expert) slots are sorted by expert (stable: token order within an expert, as the
    reference loops), run through their experts, weighted, and added back to their tokens. `kept` (a capacity,
    `kept_slots`): expert e runs only its first kept[e] slots, the earliest tokens; the others add nothing.
    None: dropless. On fake tensors (the planner's simulation) the slots are split evenly over the experts."""
    n, k = experts_of.shape
    e = experts.num_experts
    flat = experts_of.reshape(-1)  # [N·k]
    order = flat.argsort(stable=True)
    counts, split = slot_counts(flat, e)
    if kept is not None:
        order, split = order[first_slots(split, kept, flat.device)], kept
    token = order // k  # the token of each sorted slot
    out = experts(x[token], split) * weights.reshape(-1)[order].unsqueeze(-1)  # [N·k, H]
    return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype)), counts


class Router(nn.Linear):
    """The router `gate` [E, H]: logits in fp32 whatever the precision level (autocast off, weight and input
    upcast). A module call, so sharding wrappers (FSDP2's per-Linear units) gather the weight first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())  # [N, E]


class MoEFeedForward(nn.Module):
    """Router `gate` [E, H] + stacked `experts`, and, for Qwen2-MoE, a `shared_expert` MLP every token goes
    through, scaled by sigmoid(`shared_expert_gate`(x)). Drop-in for a block's dense `mlp`.

    Under model.moe_balance: aux_free the layer holds `expert_bias` [E] (fp32, a buffer outside the state dict:
    no gradient, no optimizer state, no Hugging Face name; the checkpoints keep it through
    fitlm.step.router_balance)."""

    def __init__(self, cfg, normalize: bool, shared_width: int | None = None):
        super().__init__()
        assert cfg.num_experts  # (an MoE family's config: validated)
        self.top_k, self.normalize = cfg.num_experts_per_tok, normalize
        self.capacity_factor: float | None = getattr(cfg, "capacity_factor", None)
        self.gate = Router(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size, cfg.init_std)
        if shared_width:
            self.shared_expert = GatedMLP(cfg, width=shared_width)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.expert_bias: torch.Tensor | None
        if getattr(cfg, "moe_balance", "aux_loss") == "aux_free":
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=False)
        else:
            self.expert_bias = None
        # How routed tokens reach their experts: `dispatch` here, an all-to-all under expert parallel
        # (fitlm.parallel.expert_parallel sets both); same arguments and results. `kept`: the slots per expert a
        # capacity keeps (`kept_slots`; expert parallel decides over the ep group's slots).
        self.dispatcher = dispatch
        self.kept = kept_slots
        # Of the last training forward (popped by fitlm.step.router_balance): fp32 [N, E], [E] and, under a
        # capacity, [dropped slots, routed slots].
        self.router_logits: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None
        self.dropped_slots: torch.Tensor | None = None
        # Under pipeline parallel a stage runs several chunks per micro batch before any is balanced, so the
        # routing of each training forward is handed to this callable at once instead of being kept
        # (fitlm.step.pipeline_balance): observer(layer, logits, counts, dropped, y) -> y.
        self.observer: Callable | None = None
        # Under tensor parallel with the experts split inside (fitlm.parallel.expert_tensor_parallel): identity in
        # forward, the gradient summed over tp in backward, for what feeds the split experts (their input rows,
        # routing weights and the shared expert's gate), whose gradients each rank has a partial sum of.
        self.partial_grad: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reset_expert_bias(self, device: torch.device | str | None = None) -> None:
        """A zero bias (after fitlm.parallel.materialize gave the meta-built layer uninitialised storage, or a
        meta-built model got its weights by assignment: then on `device`)."""
        if self.expert_bias is not None:
            if device is not None or self.expert_bias.is_meta:
                self.expert_bias = torch.zeros(self.expert_bias.shape, device=device)
            else:
                with torch.no_grad():
                    self.expert_bias.zero_()

    def _apply(self, fn, recurse=True):
        # The bias stays fp32 whatever the model is cast to (precision O3): 1e-3 steps vanish in bf16.
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (router logits fp32 [N, E], top-k weights fp32 [N, k], their experts [N, k]).

        With `expert_bias` the top-k are those of probabilities + bias, weighted by their unbiased probabilities."""
        logits = self.gate(x)
        probs = logits.softmax(dim=-1)
        if self.expert_bias is not None:
            experts_of = (probs + self.expert_bias.detach()).topk(self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts_of)
        else:
            weights, experts_of = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, experts_of

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        logits, weights, experts_of = self.route(flat)
        kept = dropped = None
        if self.capacity_factor is not None:
            counts, split = slot_counts(experts_of.reshape(-1), self.experts.num_experts)
            kept = self.kept(counts, split, self.capacity_factor)
            dropped = torch.tensor([float(sum(split) - sum(kept)), float(sum(split))], device=logits.device)
        summed = self.partial_grad or _identity
        y, counts = self.dispatcher(summed(flat), summed(weights.to(x.dtype)), experts_of, self.experts, kept)
        if self.observer is not None:
            y = self.observer(self, logits, counts, dropped, y)
        elif self.training and torch.is_grad_enabled():
            self.router_logits, self.expert_counts, self.dropped_slots = logits, counts, dropped
        if hasattr(self, "shared_expert"):
            y = y + summed(torch.sigmoid(self.shared_expert_gate(flat))) * self.shared_expert(flat)
        return y.reshape(x.shape)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def load_balancing_loss(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6 over top-k) of the router logits
    of every MoE layer ([N, E] each): E · sum_e f_e · P_e, with f_e the share of the N·L rows' top-k slots
    that go to expert e (k in all) and P_e the mean routing probability of e over the same rows."""
    tokens, probs, rows = balance_terms(logits, top_k)
    return tokens.numel() * torch.sum((tokens / rows) * (probs / rows))


def balance_terms(logits: list[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`load_balancing_loss`'s sums: top-k slots per expert [E], summed routing probabilities [E] (with their
    gradient) and rows (tokens x layers); sums, so ranks that split the tokens can add theirs up."""
    e = logits[0].shape[-1]
    tokens = torch.zeros(e, device=logits[0].device)
    probs = torch.zeros(e, device=logits[0].device)
    rows = 0
    for layer in logits:
        p = layer.float().softmax(dim=-1)  # [N, E]
        chosen = p.topk(top_k, dim=-1).indices.reshape(-1)  # [N·k]; a scatter (not bincount): static shapes
        tokens = tokens.scatter_add(0, chosen, torch.ones_like(chosen, dtype=tokens.dtype))
        probs = probs + p.sum(dim=0)
        rows += p.shape[0]
    return tokens, probs, rows


def moe_layers(modules) -> list[MoEFeedForward]:
    """The MoE feed-forwards inside `modules` (a model, or a pipeline rank's stages)."""
    return [m for mod in modules for m in mod.modules() if isinstance(m, MoEFeedForward)]
