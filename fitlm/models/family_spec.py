"""What the config schema knows of a model family, torch-free: `FamilySpec`.

Validating a config needs a family's defaults and refusals (MLP width, sliding-window pattern, what it
cannot build, whether it routes to experts or splits over pipeline stages) but none of its model code.
Each family folder states them in its `spec.py`, which imports neither torch nor anything that does;
the torch `Family` record (fitlm.models.family) holds its spec as `Family.spec`. This module and the
`spec.py` files form the unit `model_specs`, below the models and beside the config (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fitlm.config import ModelConfig


def _no_problems(cfg: "ModelConfig") -> list[str]:
    return []


def _sliding(i: int) -> str:
    return "sliding"


@dataclass(frozen=True)
class FamilySpec:
    name: str  # model.arch
    hf_model_types: tuple[str, ...]  # config.json model_type values read by this family
    default_ffn: Callable[[int], int]  # MLP width when model.intermediate_size is null
    default_layer_type: Callable[[int], str] = _sliding  # block i's attention with sliding_window set
    validate: Callable[["ModelConfig"], list[str]] = _no_problems  # what this family cannot build
    features: tuple[str, ...] = ()  # shown in the README families table
    tensor_parallel: bool = True  # its blocks' weights can be split over a tensor-parallel group
    pipeline_parallel: bool = True
    moe: bool = False  # blocks route tokens to experts (model.num_experts; fitlm.models.moe)


def llama_ffn(hidden: int) -> int:
    """8/3·hidden rounded up to a multiple of 256 (Llama's rule; the fitlm default for RoPE families)."""
    return 256 * ((int(8 * hidden / 3) + 255) // 256)
