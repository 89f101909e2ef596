"""Model families by unique name: the one registry, with two tables.

A family states what the config schema needs in a torch-free `FamilySpec` (fitlm.models.family_spec:
name, HF model types, defaults, refusals, TP/PP/MoE flags), registered with `register_spec`, and builds
its torch `Family` (fitlm.models.family: module class, HF adapter, TP plan, GGUF names, planner counts)
around that spec, registered with `register_family`. Configs name a family by `model.arch`, Hugging Face
configs by their `model_type`, GGUF files by `general.architecture`. Registering a taken name or
model_type is an error naming both registrants, never an overwrite.

The registry sits below every package (the config schema asks it for a family's spec), so it imports no
fitlm module. The built-in families are named by folder in BUILTIN_FAMILIES, as entry points name
plugins: a lookup of specs imports each folder's `spec` module (torch-free, so validating a config imports
no torch), a lookup of families its `family` module. A third-party family calls `register_family`, which
registers its spec too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

    from fitlm.config import ModelConfig
    from fitlm.models.family import Family
    from fitlm.models.family_spec import FamilySpec

_SPECS: dict[str, "FamilySpec"] = {}
_FAMILIES: dict[str, "Family"] = {}
# Each folder's spec.py registers its specs, its family.py its torch families, when imported.
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


def register_spec(spec: "FamilySpec") -> "FamilySpec":
    """Make `spec.name` a valid `model.arch` for config validation, reading its HF model types."""
    taken = _SPECS.get(spec.name)
    if taken is not None and taken is not spec:
        raise RegistryError(
            f"model family {spec.name!r} is registered twice: by the spec reading HF model types "
            f"{list(taken.hf_model_types)} and by one reading {list(spec.hf_model_types)}; give one of them "
            "another name"
        )
    for other in _SPECS.values():
        shared = set(other.hf_model_types) & set(spec.hf_model_types)
        if other is not spec and shared:
            raise RegistryError(
                f"Hugging Face model_type {sorted(shared)} is claimed by families {other.name!r} "
                f"and {spec.name!r}; a model_type belongs to one family"
            )
    _SPECS[spec.name] = spec
    return spec


def register_family(family: "Family") -> "Family":
    """Make `family` buildable as `model.arch: <family.spec.name>` (its spec is registered too, if new)."""
    name = family.spec.name
    taken = _FAMILIES.get(name)
    if taken is not None and taken is not family:
        raise RegistryError(
            f"model family {name!r} is registered twice: by {_qualname(taken.model_cls)} and by "
            f"{_qualname(family.model_cls)}; give one of them another name"
        )
    register_spec(family.spec)
    _FAMILIES[name] = family
    return family


def specs() -> list["FamilySpec"]:
    """Every family's spec, by name (torch-free: the built-in families' spec modules only)."""
    _load_builtin("spec")
    return [_SPECS[n] for n in sorted(_SPECS)]


def model_names() -> list[str]:
    return [s.name for s in specs()]


def get_spec(name: str) -> "FamilySpec":
    _load_builtin("spec")
    if name not in _SPECS:
        raise RegistryError(f"model.arch: unknown architecture {name!r}; registered: {', '.join(sorted(_SPECS))}")
    return _SPECS[name]


def families() -> list["Family"]:
    _load_builtin("family")
    return [_FAMILIES[n] for n in sorted(_FAMILIES)]


def get_family(name: str) -> "Family":
    _load_builtin("family")
    if name not in _FAMILIES:
        raise RegistryError(f"model.arch: unknown architecture {name!r}; registered: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


def get_model_class(name: str) -> type:
    return get_family(name).model_cls


def family_for_hf(model_type: Any) -> "Family | None":
    """The family that reads Hugging Face configs of this `model_type`, if any."""
    return next((f for f in families() if model_type in f.spec.hf_model_types), None)


def family_for_gguf(architecture: Any, experts: bool = False) -> "Family | None":
    """The family that reads GGUF files of this `general.architecture`, if any; of two (llama.cpp's `llama`
    holds Llama and Mixtral), the one that routes to experts when the file has an expert_count (`experts`)."""
    found = [f for f in families() if f.gguf is not None and architecture == f.gguf.arch]
    return next((f for f in found if f.spec.moe == experts), found[0] if found else None)


def build_model(cfg: "ModelConfig") -> "nn.Module":
    """Instantiate the registered class for `cfg.arch` (weights initialised on the current default device)."""
    return get_model_class(cfg.arch)(cfg)


def _load_builtin(part: str) -> None:
    """Import each built-in folder's `spec` or `family` module (a no-op after the first time)."""
    for folder in BUILTIN_FAMILIES:
        importlib.import_module(f"{folder}.{part}")
