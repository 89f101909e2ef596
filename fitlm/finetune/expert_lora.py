"""LoRA on the stacked experts of an MoE layer, stored as PEFT stores LoRA on each expert's nn.Linear.

Inside fitlm a layer's experts are stacked (`<layer>.mlp.experts.{gate,up,down}_proj` [E, out, in]:
fitlm.models.experts.GroupedExperts), and so are their adapters: `<layer>.mlp.experts.lora_A_<proj>` [E, r, in] and
`lora_B_<proj>` [E, out, r], expert e's A and B in row e. An adapter target is named by the projection's
parameter, `<layer>.mlp.experts.gate_proj`, among the LoRA modules.

On disk (fitlm.finetune.peft_format) each expert's adapter is its own pair under Hugging Face's per-expert names,
`<layer>.mlp.experts.<e>.gate_proj.lora_A.weight` (Mixtral: `block_sparse_moe.experts.<e>.w1`), which is what
PEFT writes for LoRA on transformers 4's expert Linears, and what PEFT on transformers 5 converts onto its fused
experts when it loads the adapter. An adapter PEFT trained on those fused experts (`target_parameters`) is read
too (`from_fused`). The router (`gate`) is never adapted: it stays frozen.
"""

from __future__ import annotations

import math
import re
from typing import Iterator, Mapping, TypeVar

import torch
import torch.nn as nn

from fitlm.models.experts import PROJECTIONS, GroupedExperts

# fitlm's stacked adapter tensors, and PEFT's per-expert ones (Qwen's mlp/gate_proj..., Mixtral's
# block_sparse_moe/w1, w3, w2)
STACKED = re.compile(r"^(?P<experts>.+\.experts)\.lora_(?P<part>[AB])_(?P<proj>gate_proj|up_proj|down_proj)$")
PER_EXPERT = re.compile(
    r"^(?P<layer>.+\.)(?P<module>mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<name>\w+)\.lora_(?P<part>[AB])\.weight$"
)
HF_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's names for fitlm's

_V = TypeVar("_V")


def expert_modules(model: nn.Module) -> dict[str, GroupedExperts]:
    """Every MoE layer's stacked experts by FQN."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def expert_targets(model: nn.Module, targets: list[str], all_linear: bool) -> list[str]:
    """The stacked projections (`<experts>.gate_proj` ...) that LoRA targets name: a projection's leaf name as
    Qwen's or Mixtral's checkpoints spell it (gate_proj / w1, up_proj / w3, down_proj / w2), a dotted suffix of the
    target's FQN, or all-linear (every expert Linear, as PEFT's all-linear takes them)."""
    out = []
    for name in expert_modules(model):
        for proj in PROJECTIONS:
            fqn = f"{name}.{proj}"
            leaves = {proj} | {hf for hf, p in HF_PROJECTIONS.items() if p == proj}
            if all_linear or any(t in leaves or fqn.endswith("." + t) for t in targets):
                out.append(fqn)
    return out


def split(module: str) -> tuple[str, str] | None:
    """`<experts>.gate_proj` -> (`<experts>`, `gate_proj`) for an expert target; None for a Linear's FQN."""
    experts, _, proj = module.rpartition(".")
    return (experts, proj) if proj in PROJECTIONS and experts.endswith(".experts") else None


def key(module: str, part: str) -> str:
    """The state-dict key of an expert target's A or B: `<experts>.lora_A_gate_proj`."""
    experts, proj = split(module) or ("", "")
    return f"{experts}.lora_{part}_{proj}"


def module_of(name: str) -> str | None:
    """The expert target a stacked adapter key belongs to (None for any other key)."""
    m = STACKED.match(name)
    return f"{m['experts']}.{m['proj']}" if m else None


def _draw(experts: int, fan_in: int, fan_out: int, r: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [E, r, in], B [E, out, r]): each expert's A Kaiming-uniform as an nn.Linear's (PEFT's default), B zero."""
    a = torch.empty(experts, r, fan_in, device=device, dtype=torch.float32)
    for e in range(experts):
        nn.init.kaiming_uniform_(a[e], a=math.sqrt(5))
    return a, torch.zeros(experts, fan_out, r, device=device, dtype=torch.float32)


def attach(experts: GroupedExperts, proj: str, r: int, scaling: float, dropout: float) -> None:
    """Give one stacked projection its adapter, on the weight's device (fitlm.models.moe runs it)."""
    w = getattr(experts, proj)  # [E, out, in]
    a, b = _draw(w.shape[0], w.shape[2], w.shape[1], r, w.device)
    setattr(experts, f"lora_A_{proj}", nn.Parameter(a))
    setattr(experts, f"lora_B_{proj}", nn.Parameter(b))
    experts.lora_scaling, experts.lora_dropout = scaling, dropout


def adapted(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in expert_modules(model).values() if any(hasattr(m, f"lora_A_{p}") for p in PROJECTIONS)]


def drawn(model: nn.Module) -> list[tuple[str, int, int, int, int]]:
    """(target, E, in, out, r) of every expert adapter, in the order `attach` drew them (see lora.lora_weights)."""
    out = []
    for name, m in expert_modules(model).items():
        for proj in PROJECTIONS:
            if hasattr(m, f"lora_A_{proj}"):
                a = getattr(m, f"lora_A_{proj}")
                # (out from the stacked shape: QLoRA stores the weight as [E·out, in])
                out.append((f"{name}.{proj}", a.shape[0], a.shape[2], m.stacked_shape(proj)[1], a.shape[1]))
    return out


def draw(target: str, experts: int, fan_in: int, fan_out: int, r: int) -> Iterator[tuple[str, torch.Tensor]]:
    a, b = _draw(experts, fan_in, fan_out, r, "cpu")
    yield key(target, "A"), a
    yield key(target, "B"), b


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W' [E, out, in] = W + scaling · B_e·A_e for every expert, in fp32."""
    return w.float() + scaling * torch.bmm(b.float(), a.float())


def to_peft(adapter: Mapping[str, _V], module: str = "mlp", names: Mapping[str, str] | None = None) -> dict[str, _V]:
    """fitlm's stacked expert adapters -> one pair per expert under the family's HF names (`module`: the MoE
    layer's HF module, `names`: fitlm projection -> HF leaf); other keys pass through."""
    out: dict[str, _V] = {}
    for k, v in adapter.items():
        m = STACKED.match(k)
        if m is None:
            out[k] = v
            continue
        layer = m["experts"].removesuffix("mlp.experts")
        leaf = (names or {}).get(m["proj"], m["proj"])
        for e in range(v.shape[0]):  # type: ignore[attr-defined]  # (tensors)
            out[f"{layer}{module}.experts.{e}.{leaf}.lora_{m['part']}.weight"] = v[e]  # type: ignore[index]
    return out


def from_peft(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's per-expert adapter pairs (either family's names) -> fitlm's stacked ones; other keys pass through.
    The experts of a layer must be numbered 0..E-1 without a gap."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in tensors.items():
        m = PER_EXPERT.match(k)
        if m is None or HF_PROJECTIONS.get(m["name"], m["name"]) not in PROJECTIONS:
            out[k] = v
            continue
        proj = HF_PROJECTIONS.get(m["name"], m["name"])
        groups.setdefault(f"{m['layer']}mlp.experts.lora_{m['part']}_{proj}", {})[int(m["e"])] = v
    for k, rows in groups.items():
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"{k}: the adapter's experts are numbered {sorted(rows)}; expected 0..{len(rows) - 1}")
        out[k] = torch.stack([rows[e] for e in range(len(rows))])
    return out


FUSED = re.compile(r"^(?P<experts>.+\.experts)(?P<inner>\.base_layer)?\.lora_(?P<part>[AB])\.weight$")


def from_fused(tensors: Mapping[str, torch.Tensor], targets: list[str], r: int) -> dict[str, torch.Tensor]:
    """PEFT's adapters on transformers 5's fused expert parameters (`target_parameters`: `experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]) -> fitlm's stacked ones; other keys pass through.

    PEFT keeps one pair per parameter, all experts in it: A [r·E, in] (expert e's rows e·r..), B [out, r·E]
    (expert e's columns e, E+e, ...), delta_e = B_e·A_e. Two targets on one module nest: the first registered
    (gate_up_proj) is the inner `base_layer`. gate_up's A is shared by fitlm's gate and up, its B split at I."""
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for k, v in tensors.items():
        m = FUSED.match(k)
        if m is None:
            out[k] = v
            continue
        both = {t.rsplit(".", 1)[-1] for t in targets} >= {"gate_up_proj", "down_proj"}
        param = (
            "gate_up_proj"
            if m["inner"] or not both and any(t.endswith("gate_up_proj") for t in targets)
            else "down_proj"
        )
        pairs.setdefault(m["experts"].replace("block_sparse_moe", "mlp"), {}).setdefault(param, {})[m["part"]] = v
    for experts, params in pairs.items():
        for param, ab in params.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{experts}.{param}: the adapter holds only lora_{''.join(ab)}")
            e = ab["A"].shape[0] // r
            a = ab["A"].reshape(e, r, ab["A"].shape[-1])  # [E, r, in]
            b = ab["B"].reshape(ab["B"].shape[0], r, e).permute(2, 0, 1).contiguous()  # [E, out, r]
            if param == "down_proj":
                out[f"{experts}.lora_A_down_proj"], out[f"{experts}.lora_B_down_proj"] = a, b
                continue
            half = b.shape[1] // 2  # gate rows first, as transformers fuses them
            out[f"{experts}.lora_A_gate_proj"], out[f"{experts}.lora_B_gate_proj"] = a, b[:, :half].contiguous()
            out[f"{experts}.lora_A_up_proj"], out[f"{experts}.lora_B_up_proj"] = a.clone(), b[:, half:].contiguous()
    return out
