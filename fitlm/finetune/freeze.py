"""Layer freezing: the bottom blocks (and optionally the embeddings) get requires_grad=False.

Frozen parameters get no gradient and, because the optimizer's parameter groups skip them, no
AdamW state either, so freezing saves 12+ bytes per frozen parameter in training state. The lower
layers of a pretrained model hold the most general features, which is why freezing goes bottom-up.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch.nn as nn

from fitlm.finetune.errors import FinetuneError

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM


def frozen_layer_count(num_layers: int, fraction: float) -> int:
    """floor(fraction · L): 0.5 of 4 layers freezes 2, 0.3 of 4 freezes 1 (never rounds up into a layer)."""
    if not 0.0 <= fraction <= 1.0:
        raise FinetuneError(f"finetune.freeze_layers: {fraction} must be a fraction between 0.0 and 1.0")
    return math.floor(fraction * num_layers + 1e-9)


def apply_freeze(model: nn.Module, fraction: float, embeddings: bool = False) -> list[str]:
    """Freeze blocks 0..n-1 (n = frozen_layer_count) and, with `embeddings`, the token (and learned
    position) embeddings; a tied output head is the embedding tensor, so it freezes with them.
    Returns the names of the parameters that stay trainable."""
    body = cast("CausalLM", model).model  # (a family's model)
    layers = body.layers
    n = frozen_layer_count(len(layers), fraction)
    for key in sorted(layers.keys(), key=int)[:n]:
        layers[key].requires_grad_(False)
    if embeddings:
        for name in ("embed_tokens", "embed_positions"):
            emb = getattr(body, name, None)
            if emb is not None:
                emb.requires_grad_(False)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise FinetuneError(
            "finetune.freeze_layers: nothing is left to train; lower freeze_layers or set "
            "finetune.freeze_embeddings: false"
        )
    return trainable
