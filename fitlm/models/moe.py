"""Mixture-of-experts feed-forward: a top-k router, stacked experts and dropless dispatch, as transformers
computes Qwen3-MoE, Qwen2-MoE and Mixtral.

Shape letters: N tokens of the call (B·T flattened), H model width, E routed experts, k experts per token,
I expert width. The experts are stacked tensors ([E, I, H] and [E, H, I]), not E modules: one parameter per
projection, so a sharding or an expert-parallel split cuts the leading dimension, and a grouped matmul can
take them whole. The router runs in fp32 whatever the precision level (autocast off), then softmax, top-k
and, where the family does, renormalization of the k weights.

Training forwards keep their router logits (`router_logits`, fp32 [N, E]) and tokens per expert
(`expert_counts`, [E]) for fitlm.step.router_balance, which adds transformers' load-balancing loss
(`load_balancing_loss`) and logs the expert load.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from fitlm.models.layers import GatedMLP


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: down(silu(gate(x)) · up(x)) with gate_proj, up_proj [E, I, H] and
    down_proj [E, H, I] (row e is expert e's nn.Linear weight under HF's per-expert names)."""

    def __init__(self, num_experts: int, hidden: int, inner: int, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(w, 0.0, self.init_std)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [M, H], rows grouped by expert in order (counts[e] rows for expert e of this rank's experts) -> [M, H].

        Three grouped matmuls (`torch.nn.functional.grouped_mm`: gate, up, down over all experts at once, the
        groups cut by the cumulative counts) where torch has the kernel for the device and dtype
        (`grouped_mm_supported`), else one matmul pair per expert that has rows (`_expert_loop`). Both give
        the same results (on CPU the grouped kernel runs a matmul per group as the loop does: equal to float
        rounding); experts with no row get a zero gradient slice. Under expert parallel the weights are DTensors
        sharded on the expert dimension and this rank computes its own E/ep experts
        (fitlm.parallel.expert_parallel)."""
        gate, up, down = (_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        dtype = _compute_dtype(x)
        traced = is_fake(x) or torch.compiler.is_compiling()
        if x.shape[0] and grouped_mm_supported(x.device, dtype, traced=traced):  # (no row: the loop's zero pass)
            return _grouped(x, counts, gate, up, down, dtype)
        return _expert_loop(x, counts, gate, up, down)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, traced: bool = False) -> bool:
    """Whether `GroupedExperts` computes with torch's grouped matmul on `device` in `dtype` (decided by the
    device, its capability and torch's version; no call is tried).

    * CUDA: bf16 on compute capability 8.0+ (torch 2.9+; torch 2.8's kernel is Hopper-only, 9.x), the
      kernels' documented inputs; fp32 and fp16 take the per-expert loop.
    * CPU: torch 2.11+ (2.8 has no CPU kernel, 2.9-2.10's needs 16-byte aligned operands, which a
      memory-mapped checkpoint does not promise), any float dtype: the kernel is a matmul per group in C++,
      the loop's results without its per-expert Python and autograd nodes.
    * `traced` (torch.compile, or the planner's fake tensors): bf16 only, the dtype torch's shape function
      for the op accepts there.
    * other devices: the loop."""
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return False
    if traced and dtype != torch.bfloat16:
        return False
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])  # (major, minor)
    if device.type == "cuda":
        if dtype != torch.bfloat16 or not torch.cuda.is_available():
            return False
        capability = torch.cuda.get_device_capability(device)
        return capability >= (8, 0) if version >= (2, 9) else capability[0] == 9
    if device.type == "cpu":
        return version >= (2, 11) and dtype in (torch.float32, torch.bfloat16, torch.float16)
    return False


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute x in here: autocast's where it is on for x's device, else x's."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _grouped(
    x: torch.Tensor, counts: list[int], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The experts as three grouped matmuls over x [M, H]; `offs` [E] int32 is where each expert's rows end.
    The op is not under autocast: operands are cast to the dtype F.linear would compute in (`dtype`)."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
    x, gate, up, down = (t.to(dtype) for t in (x, gate, up, down))
    # [E, I, H] weights as [E, H, I] (the transposed, column-major view the kernels take): rows @ weight.T
    h = F.silu(grouped_mm(x, gate.transpose(-2, -1), offs=offs)) * grouped_mm(x, up.transpose(-2, -1), offs=offs)
    return _ContiguousGrad.apply(grouped_mm(h, down.transpose(-2, -1), offs=offs))  # [M, H]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the grouped matmul's backward refuses an
    expanded one (e.g. of `out.sum()`, strides 0); a no-op for the gradient `dispatch` sends back."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _expert_loop(
    x: torch.Tensor, counts: list[int], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """One matmul pair per expert that has rows (where torch has no grouped matmul for the device/dtype)."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        if rows.shape[0]:
            h = F.silu(F.linear(rows, gate[e])) * F.linear(rows, up[e])  # [m, I]
            outs.append(F.linear(h, down[e]))  # [m, H]
    if not outs:
        # No row at all (an expert rank whose experts got no token): a zero-row pass through expert 0 keeps
        # the graph through this call and gives the weights a (zero) gradient, so the backward's all-to-alls
        # and the gradient reductions still run on this rank as on the others.
        rows = x[:0]
        outs.append(F.linear(F.silu(F.linear(rows, gate[0])) * F.linear(rows, up[0]), down[0]))
    return torch.cat(outs)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight (all of them unless expert parallel split it)."""
    return w.to_local() if isinstance(w, DTensor) else w


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts_of: torch.Tensor, experts: GroupedExperts):
    """Dropless token-choice dispatch: x [N, H], weights / experts_of [N, k] -> (sum_k w · expert(x) [N, H],
    tokens per expert [E]).

    The N·k (token, expert) slots are sorted by expert (stable: token order within an expert, as the
    reference loops), run through their experts, weighted, and added back to their tokens. On fake tensors
    (the planner's simulation) the slots are split evenly over the experts."""
    n, k = experts_of.shape
    e = experts.gate_proj.shape[0]
    flat = experts_of.reshape(-1)  # [N·k]
    order = flat.argsort(stable=True)
    if is_fake(flat):  # `fitlm plan --simulate`: no values to route by, so the planner's balanced routing
        split = [n * k // e + (i < n * k % e) for i in range(e)]
        counts = torch.tensor(split, device=flat.device)
    else:
        counts = torch.bincount(flat, minlength=e)  # [E]
        split = counts.tolist()
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
    through, scaled by sigmoid(`shared_expert_gate`(x)). Drop-in for a block's dense `mlp`."""

    def __init__(self, cfg, normalize: bool, shared_width: int | None = None):
        super().__init__()
        assert cfg.num_experts  # (an MoE family's config: validated)
        self.top_k, self.normalize = cfg.num_experts_per_tok, normalize
        self.gate = Router(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size, cfg.init_std)
        if shared_width:
            self.shared_expert = GatedMLP(cfg, width=shared_width)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # How routed tokens reach their experts: `dispatch` here, an all-to-all under expert parallel
        # (fitlm.parallel.expert_parallel sets it); same arguments and results.
        self.dispatcher = dispatch
        # Of the last training forward (popped by fitlm.step.router_balance): fp32 [N, E] and [E].
        self.router_logits: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (router logits fp32 [N, E], top-k weights fp32 [N, k], their experts [N, k])."""
        logits = self.gate(x)
        weights, experts_of = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, experts_of

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        logits, weights, experts_of = self.route(flat)
        y, counts = self.dispatcher(flat, weights.to(x.dtype), experts_of, self.experts)
        if self.training and torch.is_grad_enabled():
            self.router_logits, self.expert_counts = logits, counts
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y.reshape(x.shape)


def load_balancing_loss(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6 over top-k) of the router logits
    of every MoE layer ([N, E] each): E · sum_e f_e · P_e, with f_e the share of the N·L rows' top-k slots
    that go to expert e (k in all) and P_e the mean routing probability of e over the same rows."""
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
    return e * torch.sum((tokens / rows) * (probs / rows))


def moe_layers(modules) -> list[MoEFeedForward]:
    """The MoE feed-forwards inside `modules` (a model, or a pipeline rank's stages)."""
    return [m for mod in modules for m in mod.modules() if isinstance(m, MoEFeedForward)]
