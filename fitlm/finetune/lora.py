"""LoRA adapters injected into an unmodified model.

A targeted `nn.Linear` stays the same module under the same name: its `weight` keeps its FQN
(`model.layers.0.self_attn.q_proj.weight`), it gains two child Linears `lora_A` [r, in] and
`lora_B` [out, r] and a forward hook that adds `scaling · B(A(dropout(x)))` to its output. So
checkpoints, HF conversion and the precision/recompute/DDP/FSDP wrappers see plain modules, and the
adapter tensors are named exactly as PEFT names them (`...q_proj.lora_A.weight`).

B starts at zero, so a freshly injected model computes exactly what the base model computes.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, TypeVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.config import Config, ModelConfig
from fitlm.finetune import expert_lora
from fitlm.finetune.errors import FinetuneError
from fitlm.models.moe import Router, moe_layers
from fitlm.registry import build_model

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM

LORA_PARTS = ("lora_A", "lora_B")
ALL_LINEAR = "all-linear"
HEAD = "lm_head"  # the output head's FQN in every family (`candidate_linears` leaves it out)


class LoraError(FinetuneError):
    """A LoRA setting or adapter that does not fit the model; the message names the module and the fix."""


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter is: rank, scaling numerator, dropout and the exact modules (FQNs) it wraps."""

    r: int
    alpha: float
    dropout: float
    modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        # rsLoRA (Kalajdzievski 2023) scales by alpha/sqrt(r) so larger ranks keep learning; PEFT reads the flag.
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


def is_adapted(module: nn.Module) -> bool:
    """A Linear that `add_lora` gave an adapter (its `lora_A`/`lora_B` children)."""
    return isinstance(module, nn.Linear) and hasattr(module, "lora_A")


def candidate_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linears LoRA may wrap: every one except the output head (PEFT's `all-linear` rule too) and an MoE
    layer's router, which stays frozen (its experts' projections are targets: fitlm.finetune.expert_lora)."""
    head = getattr(model, "lm_head", None)
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not head and not name.endswith(LORA_PARTS) and not isinstance(m, Router)
    }


def resolve_targets(model: nn.Module, targets: Iterable[str]) -> tuple[str, ...]:
    """FQNs of the Linears named by `targets` (a leaf name such as `q_proj`, a dotted suffix, or
    `all-linear`), matched as PEFT matches them: the FQN equals the target or ends with `.target`."""
    targets = list(targets)
    linears = candidate_linears(model)
    if not targets:
        raise LoraError(
            "finetune.lora.target_modules is empty; name modules such as [q_proj, v_proj] or use [all-linear]"
        )
    experts = expert_lora.expert_targets(model, targets, ALL_LINEAR in targets)
    if ALL_LINEAR in targets:
        return tuple(linears) + tuple(experts)
    found, unknown = [], []
    for t in targets:
        hits = [n for n in linears if n == t or n.endswith("." + t)] + expert_lora.expert_targets(model, [t], False)
        (found.extend(hits) if hits else unknown.append(t))
    if unknown:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linears} | {n.rsplit(".", 1)[-1] for n in experts})
        raise LoraError(
            f"finetune.lora.target_modules: {', '.join(unknown)} match no linear layer of this model"
            f"{' (an MoE router, gate, stays frozen)' if moe_layers([model]) else ''}; "
            f"its linear layers are {', '.join(leaves)} (or use all-linear; the output head lm_head "
            f"is never a target)"
        )
    chosen = set(found)
    return tuple(n for n in linears if n in chosen) + tuple(n for n in experts if n in chosen)  # model order


def _lora_hook(module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    # The lora_* attributes are the ones `add_lora` sets (nn.Module's __getattr__/__setattr__ type them
    # Tensor | Module, hence the ignores here and there).
    if getattr(module, "lora_off", False):  # `adapters_off`: the base Linear's output, unchanged
        return None
    x = args[0]
    if module.lora_dropout > 0 and module.training:  # type: ignore[operator]
        x = F.dropout(x, module.lora_dropout, training=True)  # type: ignore[arg-type]
    return output + module.lora_B(module.lora_A(x)) * module.lora_scaling  # type: ignore[operator]


def new_adapter(in_features: int, out_features: int, r: int, device) -> tuple[nn.Linear, nn.Linear]:
    """(A [r, in], B [out, r]): A Kaiming-uniform (PEFT's default), B zero, fp32. On the meta device nothing
    is drawn; `lora_weights` draws the same numbers later, on the CPU."""
    a = nn.Linear(in_features, r, bias=False, device=device, dtype=torch.float32)
    b = nn.Linear(r, out_features, bias=False, device=device, dtype=torch.float32)
    nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
    nn.init.zeros_(b.weight)
    return a, b


def add_lora(linear: nn.Linear, r: int, alpha_scaling: float, dropout: float) -> None:
    """Give one Linear its adapter (`new_adapter`), on the weight's device."""
    linear.lora_A, linear.lora_B = new_adapter(linear.in_features, linear.out_features, r, linear.weight.device)
    linear.lora_scaling = alpha_scaling  # type: ignore[assignment]  # (a plain attribute: see _lora_hook)
    linear.lora_dropout = dropout  # type: ignore[assignment]
    linear.register_forward_hook(_lora_hook)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base inside this block: every adapter hook leaves its Linear's output as it is
    (DPO's reference under LoRA: the frozen base, without a second copy of it)."""
    adapted: list[nn.Module] = [m for m in model.modules() if is_adapted(m)] + list(expert_lora.adapted(model))
    for m in adapted:
        m.lora_off = True  # type: ignore[assignment]  # (a plain attribute: see _lora_hook)
    try:
        yield
    finally:
        for m in adapted:
            m.lora_off = False  # type: ignore[assignment]


def inject_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Wrap spec.modules, freeze everything else; returns the names of the trainable parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    linears = dict(model.named_modules())
    for name in spec.modules:
        stacked = expert_lora.split(name)
        if stacked is not None and isinstance(linears.get(stacked[0]), expert_lora.GroupedExperts):
            if hasattr(linears[stacked[0]], f"lora_A_{stacked[1]}"):
                raise LoraError(f"{name} already has a LoRA adapter; merge it first (`fitlm merge`) to stack another")
            expert_lora.attach(linears[stacked[0]], stacked[1], spec.r, spec.scaling, spec.dropout)
            continue
        m = linears.get(name)
        if not isinstance(m, nn.Linear):
            raise LoraError(f"adapter module {name!r} is not a linear layer of this model")
        if hasattr(m, "lora_A"):
            raise LoraError(f"{name} already has a LoRA adapter; merge it first (`fitlm merge`) to stack another")
        add_lora(m, spec.r, spec.scaling, spec.dropout)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def lora_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every adapter weight of a model whose adapters were injected on the meta device,
    drawn as `inject_lora` draws them on a real device: same order, same numbers, one module at a time.
    The adapted modules are listed now (before wrappers rename them); the numbers are drawn when iterated."""
    adapted = [
        (name, m.in_features, m.out_features, m.lora_A.out_features)
        for name, m in model.named_modules()
        if is_adapted(m)
    ]
    stacked = expert_lora.drawn(model)

    def draw() -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, fan_in, fan_out, r in adapted:
                a, b = new_adapter(fan_in, fan_out, r, "cpu")
                yield f"{name}.lora_A.weight", a.weight.detach()
                yield f"{name}.lora_B.weight", b.weight.detach()
            for target, experts, fan_in, fan_out, r in stacked:
                yield from expert_lora.draw(target, experts, fan_in, fan_out, r)

    return draw()


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float, target_modules: Iterable[str]) -> LoraSpec:
    """Inject adapters for `finetune.lora` settings into `model` (before any parallel wrapper)."""
    if r < 1:
        raise LoraError(f"finetune.lora.r: {r} must be at least 1")
    spec = LoraSpec(r=r, alpha=alpha, dropout=dropout, modules=resolve_targets(model, target_modules))
    inject_lora(model, spec)
    return spec


def is_lora_key(name: str) -> bool:
    return any(f".{part}." in name for part in LORA_PARTS) or expert_lora.module_of(name) is not None


_V = TypeVar("_V")  # a state dict's values: tensors, or (dtype, shape) specs


def split_lora_state_dict(sd: Mapping[str, _V]) -> tuple[dict[str, _V], dict[str, _V]]:
    """A LoRA model's state dict -> (base weights, adapter weights), both under fitlm FQNs."""
    base = {k: v for k, v in sd.items() if not is_lora_key(k)}
    adapter = {k: v for k, v in sd.items() if is_lora_key(k)}
    return base, adapter


def merge_lora(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scaling: float, source: str = "adapter"
) -> dict[str, torch.Tensor]:
    """W' = W + scaling · B·A for every adapted module, computed in fp32 and stored in fp32.

    Shapes are checked against the base, so an adapter trained on another model is refused instead of
    producing a silently broken merge.
    """
    out = dict(base)
    for m in lora_modules_of(adapter):
        stacked = expert_lora.split(m) is not None
        a, b = (adapter.get(adapter_key(m, part)) for part in ("A", "B"))
        w = base.get(m if stacked else f"{m}.weight")
        if a is None or b is None:
            raise LoraError(f"{source}: {m} has only one of lora_A / lora_B; the adapter is incomplete")
        if w is None:
            raise LoraError(
                f"{source}: adapts {m}, which this base model does not have: the adapter was made "
                f"for another model (or architecture); use the base model it was trained on"
            )
        expects = (*a.shape[:-2], b.shape[-2], a.shape[-1])  # ([E,] out, in)
        if a.shape[-2] != b.shape[-1] or tuple(w.shape) != expects:
            raise LoraError(
                f"{source}: {m} is {tuple(w.shape)} in the base model but the adapter expects "
                f"{expects}: the adapter was made for another base model; use the base model it was trained on"
            )
        if stacked:  # an MoE layer's experts: every expert's B_e·A_e
            out[m] = expert_lora.merge(w, a, b, scaling)
            continue
        delta = b.float() @ a.float()  # [out, r] @ [r, in]
        out[f"{m}.weight"] = (w.float() + scaling * delta).to(torch.float32)
    return out


def adapter_key(module: str, part: str) -> str:
    """The adapter key of `module`'s A or B: `<Linear>.lora_A.weight`, or an expert target's stacked key."""
    return expert_lora.key(module, part) if expert_lora.split(module) else f"{module}.lora_{part}.weight"


def untied_for(config: Config, adapter: Mapping[str, torch.Tensor]) -> Config:
    """`config` itself, or a copy with `model.tie_embeddings` false when `adapter` adapts the output head of a
    model whose head is its embedding (an adapter made with PEFT; fitlm's LoRA never targets the head).

    Base + adapter computes the head as W + s·B·A but looks tokens up in W: merged into the one shared tensor,
    the embedding would move too and the merged model would compute something else (PEFT warns of this for
    tied heads). Untied, the merged model computes what base + adapter computed."""
    if not config.model.tie_embeddings or HEAD not in lora_modules_of(adapter):
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"tie_embeddings": False})})


def with_weights(model: nn.Module, model_cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """`model` holding `weights` (a merged state dict); a new module, built without an init pass, when
    `model_cfg` unties a head that `model` ties (`untied_for`), so the head and the embedding stay two tensors."""
    if cast("CausalLM", model).config.tie_embeddings == model_cfg.tie_embeddings:  # (a family's model)
        model.load_state_dict(weights)
        return model
    device = next(iter(weights.values())).device
    with torch.device("meta"):
        out = cast("CausalLM", build_model(model_cfg))  # (a registered family's model)
    out.load_state_dict(dict(weights), strict=True, assign=True)
    out.init_buffers(device)
    return out.train(model.training)


def lora_modules_of(adapter: Mapping[str, object]) -> tuple[str, ...]:
    """The modules an adapter's keys adapt: Linear FQNs, and expert targets (`<experts>.gate_proj`)."""
    return tuple(sorted({expert_lora.module_of(k) or k.rsplit(".lora_", 1)[0] for k in adapter}))
