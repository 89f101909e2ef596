"""Model architectures by unique name.

A family registers its `nn.Module` class once (`@register_model("llama")`); configs name it by
`model.arch`. Registering a taken name is an error naming both registrants, never an overwrite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    import torch.nn as nn

    from fitlm.config import ModelConfig

T = TypeVar("T")
_MODELS: dict[str, type] = {}


class RegistryError(ValueError):
    pass


def _qualname(obj: type) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def register_model(name: str) -> Callable[[T], T]:
    """Class decorator: make `cls` buildable as `model.arch: <name>`."""

    def deco(cls: T) -> T:
        if name in _MODELS and _MODELS[name] is not cls:
            raise RegistryError(
                f"model architecture {name!r} is registered twice: by {_qualname(_MODELS[name])} and by "
                f"{_qualname(cls)}; give one of them another name")
        _MODELS[name] = cls
        return cls

    return deco


def model_names() -> list[str]:
    _load_builtin()
    return sorted(_MODELS)


def get_model_class(name: str) -> type:
    _load_builtin()
    if name not in _MODELS:
        raise RegistryError(f"model.arch: unknown architecture {name!r}; registered: {', '.join(sorted(_MODELS))}")
    return _MODELS[name]


def build_model(cfg: "ModelConfig") -> "nn.Module":
    """Instantiate the registered class for `cfg.arch` (weights initialised on the current default device)."""
    return get_model_class(cfg.arch)(cfg)


def _load_builtin() -> None:
    import fitlm.models  # noqa: F401  (registers the built-in families on import)
