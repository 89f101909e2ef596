"""QLoRA: LoRA adapters on a frozen base whose linear layers are stored in 4-bit NF4 (`fitlm.memory.nf4`).

Every Linear LoRA may target (all of them but the output head, PEFT's `all-linear` set) is quantized,
targeted or not, as QLoRA does, and so are an MoE layer's stacked experts (one NF4 tensor per projection,
[E, out, in] stored 2-D as [E·out, in], each expert's weights whole blocks of 64 and whole double-quantization
groups; the experts then run one at a time, each dequantized for its own matmuls:
fitlm.models.experts.GroupedExperts.take). Under ZeRO-2/3 FSDP2 shards those codes by rows as a Linear's, E/shards
whole experts a rank (E must divide by the shards), and gathers them per block. Under expert parallel the codes
split by rows as the stacked tensors split by experts (a DTensor Shard(0) over "ep": each rank's E/ep experts,
[E/ep·out, in], which `take` reads with count E/ep), and ZeRO-2/3 splits those over their edp replicas. The
router (a Linear LoRA never targets) keeps the base's storage, as do embeddings, norms, biases and the head
(half under O2). It runs on the meta model after `inject_lora` and before any wrapper, so FSDP2 shards
the 4-bit codes and `fitlm.parallel.materialize` quantizes each weight as it streams past.

A weight whose shard would split a double-quantization group (`nf4.scaler_block` is None: a dimension
that is not a multiple of 64 × 64 / shards, say) stays in the base's dtype; `quantize_base` names them. So do
stacked experts whose count their row shards (`ParallelDims.expert_param_shards`) do not divide.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, cast

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from fitlm.finetune.expert_lora import expert_modules
from fitlm.finetune.lora import LoraError, candidate_linears
from fitlm.memory import nf4
from fitlm.models.experts import PROJECTIONS, GroupedExperts
from fitlm.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torchao.quantization import NF4Tensor  # untyped: Any to mypy

RECIPE_FILE = "fitlm_qlora.json"  # beside a QLoRA run's PEFT adapter: the base as the adapter saw it


def quantize_base(model: nn.Module, dims: ParallelDims | None = None) -> list[str]:
    """Store the frozen candidate Linears' weights of `model` (on meta) as NF4 parameters whose rows split evenly
    into `dims.param_shards` (the ZeRO-2/3 degree, 1 otherwise), and the stacked experts whose experts split evenly
    into `dims.expert_param_shards` (expert parallel's, times ZeRO-2/3's). Returns the weights left unquantized."""
    dims = dims or ParallelDims()
    shards = dims.param_shards
    kept: list[str] = []
    quantized: list[str] = []
    for name, linear in candidate_linears(model).items():
        w = linear.weight
        if w.requires_grad:
            continue
        scaler = nf4.scaler_block(tuple(w.shape), shards)
        if scaler is None:
            kept.append(name)
            continue
        linear.weight = nf4.quantized_meta(w, scaler)
        quantized.append(f"{name}.weight")
    for name, experts in expert_modules(model).items():
        stored = _quantize_experts(experts, dims.expert_param_shards, dims.ep)
        kept += [f"{name}.{p}" for p in PROJECTIONS if p not in stored]
        quantized += [f"{name}.{p}" for p in stored]
    # DDP broadcasts every parameter at construction and cannot pack NF4 codes; frozen, they need no sync
    # (each rank quantizes the same full weights).
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(quantized)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(ignored))
    return kept


def _quantize_experts(experts: GroupedExperts, shards: int, expert_parallel: int) -> list[str]:
    """Store the frozen stacked projections of one MoE layer (on meta) in NF4 as [E·out, in], each expert's weights
    whole blocks and groups of one tensor and each of the `shards` row blocks whole experts
    (`nf4.stacked_scaler_block`), read one expert at a time in forward (`nf4.expert`) from this rank's E/ep
    experts' rows (all E without expert parallel). Returns the projections stored."""
    stored = []
    for proj in PROJECTIONS:
        w = getattr(experts, proj)  # [E, out, in]
        scaler = nf4.stacked_scaler_block(tuple(w.shape), shards)
        if w.requires_grad or scaler is None:
            continue
        setattr(experts, proj, nf4.quantized_meta(w, scaler))  # [E·out, in]
        stored.append(proj)
    if stored:
        experts.take = partial(nf4.expert, count=experts.num_experts // expert_parallel)  # the local experts
    return stored


def recipe_of(model: nn.Module) -> dict[str, int]:
    """Weight name -> double-quantization group of every NF4 weight of `model`: how the base was stored."""
    return {name: cast("NF4Tensor", p).scaler_block_size for name, p in model.named_parameters() if nf4.is_nf4(p)}


def write_recipe(adapter_dir: Path, recipe: Mapping[str, int]) -> None:
    """Record the quantized base beside the adapter (PEFT reads only its own two files and ignores this one)."""
    body = {
        "method": "qlora",
        "format": "nf4",
        "block_size": nf4.BLOCK,
        "stored_dtype": str(nf4.STORED_DTYPE),
        "weights": dict(recipe),
    }
    (adapter_dir / RECIPE_FILE).write_text(json.dumps(body, indent=2) + "\n")


def read_recipe(adapter_dir: str | Path) -> dict[str, int] | None:
    """The quantized base an adapter was trained on (None: a LoRA adapter on the weights as they are)."""
    f = Path(adapter_dir).expanduser() / RECIPE_FILE
    if not f.is_file():
        return None
    try:
        body = json.loads(f.read_text())
        if body["format"] != "nf4" or body["block_size"] != nf4.BLOCK:
            raise ValueError(f"format {body['format']!r} with block_size {body['block_size']} (fitlm reads nf4, 64)")
        return {str(k): int(v) for k, v in body["weights"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise LoraError(
            f"{f}: not a QLoRA recipe fitlm can read ({e}); it records how the base was quantized "
            f"for this adapter. Restore it from the training run's adapter/, or delete it to merge "
            f"onto the unquantized base"
        ) from None


@torch.no_grad()
def as_trained(weights: Mapping[str, torch.Tensor], recipe: Mapping[str, int] | None) -> dict[str, torch.Tensor]:
    """`weights` (any subset of a base's, full tensors) as a QLoRA run computed with them: each weight the recipe
    names quantized to NF4 and dequantized, in fp32. Nothing changes without a recipe."""
    if not recipe:
        return dict(weights)
    return {k: nf4.round_trip(v, recipe[k]) if k in recipe else v for k, v in weights.items()}
