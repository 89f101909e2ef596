"""Where fine-tuning meets the trainer: set a plain model up for `finetune.method`, and turn the
trained state into the final weights.

`apply_finetune` runs on the plain model before `parallelize` (so every wrapper sees ordinary
modules with their usual names). `final_weights` runs on rank 0 on the trained weights as they are
gathered block by block: for LoRA it writes the adapter in PEFT format to `output_dir/adapter/` and
gives base + scale·BA, so `output_dir/model/` is a plain model that needs no adapter code.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn

from fitlm.config import Config, ModelConfig
from fitlm.finetune.freeze import apply_freeze
from fitlm.finetune.lora import (
    LoraError,
    LoraSpec,
    apply_lora,
    is_adapted,
    lora_modules_of,
    merge_lora,
    split_lora_state_dict,
)
from fitlm.finetune.peft_format import save_adapter
from fitlm.finetune.qlora import quantize_base, recipe_of
from fitlm.memory.nf4 import is_nf4
from fitlm.memory.precision import half_dtype
from fitlm.registry import build_model

ADAPTER_DIR = "adapter"


def stores_frozen_in_half(cfg: Config) -> bool:
    """O2 computes with half casts of every weight anyway, so a frozen weight needs no fp32 master copy:
    it is stored in half (half the bytes). Under ZeRO-2/3 too: FSDP2 casts each shard to the half
    param_dtype before its all-gather, and a shard already in half is gathered as it is, so compute sees
    the same bits while the shards and the gathers' inputs shrink. O3 stores everything in half already."""
    return cfg.memory.mixed_precision == "O2"


def apply_finetune(model: nn.Module, cfg: Config) -> list[str]:
    """Freeze / inject adapters per cfg.finetune; returns the trainable parameter names."""
    f = cfg.finetune
    if f.method == "full":
        return [n for n, p in model.named_parameters() if p.requires_grad]
    if f.method == "freeze":
        trainable = apply_freeze(model, f.freeze_layers, f.freeze_embeddings)
    else:
        lora = f.lora
        apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules)
        refuse_unshardable_adapters(model, cfg)
        if f.method == "qlora":
            quantize_base(model, cfg.parallel.dims)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if stores_frozen_in_half(cfg):
        dtype = half_dtype(cfg.memory)
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and not is_nf4(p):
                p.data = p.data.to(dtype)  # same Parameter object: tied weights stay tied
    return trainable


def linears_replaced_by(model: nn.Module, prepare: Callable[[nn.Module], None]) -> set[str]:
    """The Linears that `prepare` (a family's module surgery for tensor parallel: Phi-3 splits its fused
    qkv_proj / gate_up_proj) replaces, found on a copy of `model` (the trainer's is on the meta device, so
    the copy holds no storage).

    An adapter on one of them is refused rather than split with it: one adapter on [q; k; v] shares its A
    between the three outputs, which separate q/k/v adapters cannot express, and the PEFT export must
    keep the fused names HF's Phi-3 has."""
    probe = copy.deepcopy(model)
    prepare(probe)
    after = {name for name, _ in probe.named_modules()}
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in after}


def refuse_unshardable_adapters(model: nn.Module, cfg: Config) -> None:
    """Under tensor parallel a family's module surgery (Phi-3 splits its fused projections) must not remove
    an adapted Linear; say which targets to use instead."""
    prepare = cfg.model.family.prepare_tensor_parallel
    if cfg.parallel.tensor_parallel == 1 or prepare is None:
        return
    replaced = linears_replaced_by(model, prepare)
    lost = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name in replaced and is_adapted(m)})
    if lost:
        split = {name.rsplit(".", 1)[-1] for name in replaced}
        kept = [t for t in cfg.model.family.lora_linears if t not in split]
        raise LoraError(
            f"finetune.lora.target_modules: {', '.join(lost)} are fused projections of "
            f"model.arch={cfg.model.arch} that tensor parallel splits into separate Linears, and one "
            f"adapter on the fused matrix cannot be split with them; with tensor_parallel > 1 target "
            f"only {kept}, or set parallel.tensor_parallel: 1 (data and pipeline parallel keep the "
            f"fused adapters)"
        )


def spec_from_config(cfg: Config, adapter: Mapping[str, object]) -> LoraSpec:
    lora = cfg.finetune.lora
    return LoraSpec(r=lora.r, alpha=lora.alpha, dropout=lora.dropout, modules=lora_modules_of(adapter))


def final_weights(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    blocks: Iterable[dict[str, torch.Tensor] | None],
    cfg: Config,
    output_dir: str | Path,
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Iterator[dict[str, torch.Tensor]]]:
    """The plain model's weights from the trained ones, block by block (rank 0, from
    `fitlm.parallel.gather.full_groups`): (specs, blocks) of what `output_dir/model/` holds.

    LoRA: each block's adapters are merged into its weights, in fp32 (a block holds both, so no more
    than one block is in memory), and once the last block has passed the adapter goes to
    `output_dir/adapter/` in PEFT format. Under O2 the frozen base was held in half, so the merged
    base carries that rounding; merge the adapter onto the original weights with
    `fitlm merge BASE --adapter output_dir/adapter` for an exact fp32 result.
    """
    if not cfg.finetune.adapters:
        return dict(specs), (b for b in blocks if b is not None)
    base_specs, adapter_specs = split_lora_state_dict(specs)
    spec = spec_from_config(cfg, adapter_specs)
    plain = {
        k: (torch.float32 if dtype.is_floating_point else dtype, shape) for k, (dtype, shape) in base_specs.items()
    }

    def merged() -> Iterator[dict[str, torch.Tensor]]:
        adapter: dict[str, torch.Tensor] = {}
        for block in blocks:
            assert block is not None  # (rank 0's blocks)
            base, ours = split_lora_state_dict(block)
            adapter.update(ours)
            out = {
                k: v.float() if v.is_floating_point() else v for k, v in merge_lora(base, ours, spec.scaling).items()
            }
            del block, base, ours  # the gathered block goes before the next is gathered (rank 0's save peak)
            yield out
            del out
        save_adapter(
            adapter,
            spec,
            Path(output_dir) / ADAPTER_DIR,
            base_model=cfg.model.init_from,
            recipe=quantized_recipe(cfg) if cfg.finetune.method == "qlora" else None,
            experts=expert_names(cfg.model),
        )

    return plain, merged()


def expert_names(model: ModelConfig) -> tuple[str, dict[str, str]]:
    """How the family's checkpoints name an MoE layer and its expert projections (for adapters on experts)."""
    gguf = model.family.gguf  # (the family's HF expert names live with its GGUF names, which stack them)
    names = gguf.experts if gguf is not None else None
    if names is None:
        return "mlp", {}
    return names.module, {"gate_proj": names.gate, "up_proj": names.up, "down_proj": names.down}


def quantized_recipe(cfg: Config) -> dict[str, int]:
    """The NF4 weights `apply_finetune` gives a QLoRA run's model, and their groups (built again on the meta
    device: no storage), for the adapter's `fitlm.finetune.qlora.RECIPE_FILE`."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    apply_finetune(model, cfg)
    return recipe_of(model)
