"""Model families by unique name: the one registry.

A family (`fitlm.models.family.Family`: module class, HF adapter, TP plan, GGUF names, planner counts)
registers itself once with `register_family`; configs name it by `model.arch`, Hugging Face configs by
their `model_type`, GGUF files by `general.architecture`. Registering a taken name is an error naming
both registrants, never an overwrite.

The registry sits below every package (the config schema asks it for a family's defaults), so it
imports no fitlm module. The built-in families are named by module path in BUILTIN_FAMILIES, as entry
points name plugins, and imported on the first lookup; a third-party family calls `register_family`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

    from fitlm.config import ModelConfig
    from fitlm.models.family import Family

_FAMILIES: dict[str, "Family"] = {}
# Each module registers its families when imported (families() lists them by name).
BUILTIN_FAMILIES = (
    "fitlm.models.llama",
    "fitlm.models.qwen",
    "fitlm.models.qwen_moe",
    "fitlm.models.mixtral",
    "fitlm.models.gemma",
    "fitlm.models.phi3",
    "fitlm.models.gpt2",
)


class RegistryError(ValueError):
    pass


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def register_family(family: "Family") -> "Family":
    """Make `family` buildable as `model.arch: <family.name>` and readable by its HF model types."""
    taken = _FAMILIES.get(family.name)
    if taken is not None and taken is not family:
        raise RegistryError(
            f"model family {family.name!r} is registered twice: by {_qualname(taken.model_cls)} and by "
            f"{_qualname(family.model_cls)}; give one of them another name"
        )
    for other in _FAMILIES.values():
        shared = set(other.hf_model_types) & set(family.hf_model_types)
        if other is not family and shared:
            raise RegistryError(
                f"Hugging Face model_type {sorted(shared)} is claimed by families {other.name!r} "
                f"and {family.name!r}; a model_type belongs to one family"
            )
    _FAMILIES[family.name] = family
    return family


def families() -> list["Family"]:
    _load_builtin()
    return [_FAMILIES[n] for n in sorted(_FAMILIES)]


def model_names() -> list[str]:
    return [f.name for f in families()]


def get_family(name: str) -> "Family":
    _load_builtin()
    if name not in _FAMILIES:
        raise RegistryError(f"model.arch: unknown architecture {name!r}; registered: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


def get_model_class(name: str) -> type:
    return get_family(name).model_cls


def family_for_hf(model_type: Any) -> "Family | None":
    """The family that reads Hugging Face configs of this `model_type`, if any."""
    return next((f for f in families() if model_type in f.hf_model_types), None)


def family_for_gguf(architecture: Any, experts: bool = False) -> "Family | None":
    """The family that reads GGUF files of this `general.architecture`, if any; of two (llama.cpp's `llama`
    holds Llama and Mixtral), the one that routes to experts when the file has an expert_count (`experts`)."""
    found = [f for f in families() if f.gguf is not None and architecture == f.gguf.arch]
    return next((f for f in found if f.moe == experts), found[0] if found else None)


def build_model(cfg: "ModelConfig") -> "nn.Module":
    """Instantiate the registered class for `cfg.arch` (weights initialised on the current default device)."""
    return get_model_class(cfg.arch)(cfg)


def _load_builtin() -> None:
    for module in BUILTIN_FAMILIES:
        importlib.import_module(module)  # a no-op after the first time
