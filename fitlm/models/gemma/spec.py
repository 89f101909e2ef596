"""The Gemma family specs: Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3`), with their layer patterns."""

from __future__ import annotations

from fitlm.models.family_spec import FamilySpec
from fitlm.registry import register_spec


def gemma2_layer_type(i: int) -> str:
    return "sliding" if i % 2 == 0 else "full"  # even blocks slide


def gemma3_layer_type(i: int, pattern: int = 6) -> str:
    return "full" if (i + 1) % pattern == 0 else "sliding"  # five sliding, then one global


def _ffn(hidden: int) -> int:
    return 8 * hidden  # Gemma's MLPs are about 8x wide (2B: 2304 -> 9216)


GEMMA2 = register_spec(
    FamilySpec(
        name="gemma2",
        hf_model_types=("gemma2",),
        default_ffn=_ffn,
        default_layer_type=gemma2_layer_type,
        features=(
            "(1 + w) RMSNorm, sqrt(hidden) embedding scale, GeGLU",
            "pre- and post-norms",
            "attention and final logit soft-capping",
            "alternating sliding-window / global layers",
        ),
    )
)

GEMMA3 = register_spec(
    FamilySpec(
        name="gemma3",
        hf_model_types=("gemma3_text", "gemma3"),
        default_ffn=_ffn,
        default_layer_type=gemma3_layer_type,
        features=(
            "Gemma 2's block with per-head q/k norm",
            "local/global RoPE bases",
            "5 sliding : 1 global layers",
            "multimodal checkpoints (4B+): the language model, exported text-only",
        ),
    )
)
