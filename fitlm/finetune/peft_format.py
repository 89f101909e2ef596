"""LoRA adapters on disk in the PEFT format, so `peft.PeftModel.from_pretrained` reads fitlm's and fitlm reads PEFT's.

    adapter_config.json         {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r", "lora_alpha",
                                 "lora_dropout", "target_modules", "bias": "none", ...}
    adapter_model.safetensors   base_model.model.<module FQN>.lora_A.weight [r, in] / .lora_B.weight [out, r]

fitlm's Llama FQNs are Hugging Face's, so no renaming is needed for the llama family. GPT-2 in fitlm
has split q/k/v projections where HF has one fused Conv1D (`c_attn`), so a fitlm GPT-2 adapter keeps
fitlm's names: fitlm merges it, PEFT cannot load it onto an HF GPT-2 (merge first, then export).
Only plain LoRA is read: DoRA, per-module rank/alpha patterns, trained embeddings (`modules_to_save`),
bias training and Conv1D (`fan_in_fan_out`) adapters are refused with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from fitlm.atomic import atomic_dir
from fitlm.diskspace import disk_full_guard, tensor_bytes
from fitlm.finetune import expert_lora
from fitlm.finetune.lora import LoraError, LoraSpec, adapter_key, lora_modules_of
from fitlm.finetune.qlora import write_recipe

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def adapter_config(
    spec: LoraSpec, base_model: str | None = None, expert_names: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """PEFT's adapter_config.json of `spec`; an expert target is listed by the family's HF leaf name
    (`expert_names`: fitlm projection -> HF's, e.g. Mixtral's gate_proj -> w1), which PEFT on transformers 5 maps
    onto its fused experts (a leaf also names a dense layer's or the shared expert's Linear of that name: on
    those PEFT finds no pair in the file and leaves them as they are)."""
    names = expert_names or {}
    leaves = sorted(
        {
            names.get(leaf, leaf) if expert_lora.split(m) else leaf
            for m in spec.modules
            for leaf in [m.rsplit(".", 1)[-1]]
        }
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": leaves,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_adapter(
    adapter: Mapping[str, torch.Tensor],
    spec: LoraSpec,
    out_dir: str | Path,
    base_model: str | None = None,
    recipe: Mapping[str, int] | None = None,
    experts: tuple[str, Mapping[str, str]] = ("mlp", {}),
) -> Path:
    """Write adapter tensors (fitlm FQNs) and their config as a PEFT adapter directory, atomically; a full
    disk raises fitlm.diskspace.DiskFullError after the partial directory is removed. `recipe`: QLoRA's
    quantized base (`fitlm.finetune.qlora.write_recipe`), recorded beside the adapter. `experts`: how the
    family's checkpoints name an MoE layer and its expert projections (fitlm.models.moe_hf.ExpertNames), for
    adapters on experts, which are written one pair per expert (fitlm.finetune.expert_lora)."""
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not (out_dir / CONFIG_FILE).is_file() and any(out_dir.iterdir()):
        raise LoraError(f"{out_dir} exists, is not empty and holds no adapter; choose another path for the adapter")
    needed = tensor_bytes(adapter.values(), float_itemsize=4) + 64 * 1024  # stored as float32
    with disk_full_guard(out_dir, needed, "adapter save"), atomic_dir(out_dir) as tmp:
        per_expert = expert_lora.to_peft(adapter, *experts)
        tensors = {PREFIX + k: v.detach().to("cpu", torch.float32).contiguous() for k, v in per_expert.items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        config = adapter_config(spec, base_model, experts[1])
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if recipe:
            write_recipe(tmp, recipe)
    return out_dir


def _refusals(cfg: Mapping[str, Any]) -> list[str]:
    out = []
    if cfg.get("peft_type", "LORA") != "LORA":
        out.append(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        out.append("use_dora=true (DoRA)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        out.append("rank_pattern/alpha_pattern (per-module ranks)")
    if cfg.get("modules_to_save"):
        out.append(f"modules_to_save={cfg['modules_to_save']} (fully trained extra modules)")
    if cfg.get("bias", "none") != "none":
        out.append(f"bias={cfg['bias']!r} (trained biases)")
    if cfg.get("fan_in_fan_out"):
        out.append("fan_in_fan_out=true (Conv1D layers, e.g. HF GPT-2's c_attn)")
    return out


def load_adapter(path: str | Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """Read a PEFT LoRA adapter directory -> (spec, tensors under fitlm FQNs). Only safetensors are read."""
    d = Path(path).expanduser()
    cfg_file, weights = d / CONFIG_FILE, d / WEIGHTS_FILE
    if not cfg_file.is_file():
        raise LoraError(
            f"{d}: no {CONFIG_FILE}; pass a PEFT LoRA adapter directory (adapter_config.json + "
            f"adapter_model.safetensors), e.g. a training run's adapter/"
        )
    if not weights.is_file():
        pickled = d / "adapter_model.bin"
        if pickled.is_file():
            raise LoraError(
                f"{d} holds adapter_model.bin, a pickle, which fitlm never loads (it can run code). "
                f"Re-save it in a trusted environment with PeftModel.save_pretrained(DIR, "
                f"safe_serialization=True) and pass DIR"
            )
        raise LoraError(f"{d}: {WEIGHTS_FILE} is missing; the adapter directory is incomplete")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise LoraError(f"{cfg_file}: not valid JSON ({e})") from None
    problems = _refusals(cfg)
    if problems:
        raise LoraError(f"{cfg_file}: this adapter uses PEFT features fitlm does not implement: {'; '.join(problems)}")
    tensors: dict[str, torch.Tensor] = {}
    for key, t in load_file(str(weights)).items():
        name = key.removeprefix(PREFIX)
        # Some writers keep the adapter name: q_proj.lora_A.default.weight.
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.default.", f".{part}.")
        if ".lora_A." not in name and ".lora_B." not in name:
            raise LoraError(f"{weights}: tensor {key!r} is not a LoRA A/B matrix; only plain LoRA adapters are read")
        tensors[name] = t
    try:
        tensors = expert_lora.from_peft(tensors)  # one pair per expert -> the stacked experts' adapters
        if cfg.get("target_parameters"):  # PEFT on transformers 5's fused experts
            tensors = expert_lora.from_fused(tensors, list(cfg["target_parameters"]), int(cfg.get("r", 8)))
    except ValueError as e:
        raise LoraError(f"{weights}: {e}") from None
    modules = lora_modules_of(tensors)
    if not modules:
        raise LoraError(f"{weights}: holds no LoRA tensors")
    ranks = {tensors[adapter_key(m, "A")].shape[-2] for m in modules if adapter_key(m, "A") in tensors}
    r = int(cfg.get("r", 8))
    if ranks != {r}:
        raise LoraError(
            f"{cfg_file}: r={r} but the adapter's matrices have rank {sorted(ranks)}; the files do not match"
        )
    spec = LoraSpec(
        r=r,
        alpha=float(cfg.get("lora_alpha", 8)),
        dropout=float(cfg.get("lora_dropout", 0.0)),
        modules=modules,
        use_rslora=bool(cfg.get("use_rslora", False)),
    )
    return spec, tensors
