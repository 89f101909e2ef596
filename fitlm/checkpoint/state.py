"""What a checkpoint holds, in names that do not depend on the parallel layout.

Model tensors are keyed by their fully qualified names in the unsplit model (pipeline stages keep
them), optimizer states by the name of their parameter (`optim.<fqn>.exp_avg`, ...), so any layout
can read any other's checkpoint: torch.distributed.checkpoint reshards DTensor (tensor parallel,
FSDP2) and plain tensors on load. Optimizer states are gathered per parameter from the optimizer
this rank steps (plain AdamW, or the local optimizer inside ZeRO-1's ZeroRedundancyOptimizer, whose
ranks each own whole parameters), so ZeRO-1 needs no consolidation: each rank writes what it owns.
RNG states are per rank (`rng.rank<r>.*`), restored only when the world size is unchanged.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from fitlm.checkpoint.errors import CheckpointError
from fitlm.memory.nf4 import is_nf4
from fitlm.parallel.data_parallel import unwrap
from fitlm.parallel.pipeline_state import TIED_COPY  # marks a last pipeline stage's copy of a tied embedding

TIED_SOURCE = "model.embed_tokens.weight"


def model_state(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's model tensors (views of the live parameters, so a load writes into them)."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        out.update({k: v for k, v in unwrap(module).state_dict().items() if not _quantized(v)})
    return out


def _quantized(t: torch.Tensor) -> bool:
    """QLoRA's frozen 4-bit base: not checkpointed (it never changes); a resume quantizes model.init_from again."""
    return is_nf4(t.to_local() if isinstance(t, DTensor) else t)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose `state` this rank steps: ZeRO-1 keeps it inside the wrapper."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def param_names(modules: list[nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for module in modules:
        for name, p in unwrap(module).named_parameters():
            names.setdefault(id(p), name)
    return names


def _optimizer_params(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    names = param_names(modules)
    out = []
    for group in local_optimizer(optimizer).param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise RuntimeError(
                    "checkpoint: an optimizer parameter is not a parameter of the model; "
                    "fitlm.checkpoint.state cannot name its state"
                )
            out.append((names[id(p)], p))
    return out


def optimizer_state(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """`<fqn>.<state name>` -> tensor for every parameter this rank's optimizer owns."""
    opt = local_optimizer(optimizer)
    out: dict[str, torch.Tensor] = {}
    for name, p in _optimizer_params(optimizer, modules):
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
            else:  # e.g. a plain-number step: kept as a tensor so it reshards like the rest
                out[f"{name}.{key}"] = torch.tensor(value)
    return out


def optimizer_template(
    optimizer: torch.optim.Optimizer, modules: list[nn.Module], md: Metadata, prefix: str = "optim."
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, str, str]]]:
    """Empty tensors for the states this rank's optimizer will own, shaped like the checkpoint's.

    Returns (state dict to load into, [(param, key in that dict, state name)]). A pipeline's tied head
    copy reads the embedding's states when the checkpoint (saved without pipeline) has none of its own.
    """
    keys = md.state_dict_metadata
    template: dict[str, torch.Tensor] = {}
    targets: list[tuple[torch.Tensor, str, str]] = []
    for name, p in _optimizer_params(optimizer, modules):
        candidates = [name] + ([TIED_SOURCE] if getattr(p, TIED_COPY, False) else [])
        source = next((c for c in candidates if any(k.startswith(f"{prefix}{c}.") for k in keys)), None)
        if source is None:
            raise CheckpointError(
                f"the checkpoint has no optimizer state for parameter {name}; it was saved from "
                "another model or fine-tuning method. Resume with the config it was saved with"
            )
        for key, entry in keys.items():
            if not key.startswith(f"{prefix}{source}.") or not isinstance(entry, TensorStorageMetadata):
                continue
            state = key[len(prefix) + len(source) + 1 :]
            dtype = entry.properties.dtype
            if tuple(entry.size) == tuple(p.shape):
                t = torch.zeros_like(p, dtype=dtype)  # DTensor params give DTensor states with their placements
            else:
                t = torch.zeros(tuple(entry.size), dtype=dtype)  # scalars such as Adam's step live on the host
            template[key[len(prefix) :]] = t  # loaded as {"optim": template}
            targets.append((p, key[len(prefix) :], state))
    return template, targets


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer, loaded: dict[str, torch.Tensor], targets: list[tuple[torch.Tensor, str, str]]
) -> None:
    opt = local_optimizer(optimizer)
    used: set[str] = set()
    for p, key, state in targets:
        # Two parameters read one entry (tied copy on the rank holding the embedding): each gets its own tensor.
        opt.state.setdefault(p, {})[state] = loaded[key].clone() if key in used else loaded[key]
        used.add(key)


def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def full_shapes(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items()}  # DTensor.shape is the global shape


def check_model_keys(sd: dict[str, torch.Tensor], md: Metadata, ckpt: str, prefix: str = "model.") -> None:
    """Refuse before loading when names or shapes differ: another model shape, said in terms of tensors."""
    stored = {k[len(prefix) :]: v for k, v in md.state_dict_metadata.items() if k.startswith(prefix)}
    missing = sorted(set(sd) - set(stored))
    bad = [  # (the casts: mypy does not narrow stored[k] by the isinstance)
        f"{k}: checkpoint {list(cast(TensorStorageMetadata, stored[k]).size)} vs model {list(s)}"
        for k, s in full_shapes(sd).items()
        if k in stored
        and isinstance(stored[k], TensorStorageMetadata)
        and tuple(cast(TensorStorageMetadata, stored[k]).size) != s
    ]
    if missing or bad:
        parts = (
            [f"missing tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"] if missing else []
        ) + bad[:5]
        raise CheckpointError(
            f"checkpoint {ckpt} was saved from another model shape ({'; '.join(parts)}); resume "
            "with the model section it was saved with, or start a fresh run in another "
            "train.output_dir"
        )


# --------------------------------------------------------------------------- small stateful objects as JSON


def encode_state(obj: Any) -> Any:
    """A state_dict of numbers, strings and small tensors -> JSON (tensors keep dtype and exact values)."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.detach().cpu().tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        return {str(k): encode_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_state(v) for v in obj]
    return obj


def decode_state(obj: Any) -> Any:
    if isinstance(obj, dict) and "__tensor__" in obj:
        return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
    if isinstance(obj, dict):
        return {k: decode_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_state(v) for v in obj]
    return obj
