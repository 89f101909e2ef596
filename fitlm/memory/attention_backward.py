"""memory.attention_backward (applied from outside the model, like the other memory options): `matmul` points
every attention layer's `attend` at fitlm.models.matmul_attention.attend, SDPA's forward with a blocked matmul
backward on CPU. Context parallel sets its own `attend` instead (fitlm.rules refuses both)."""

from __future__ import annotations

import torch.nn as nn

from fitlm.models.layers import SelfAttention
from fitlm.models.matmul_attention import attend


def apply_attention_backward(model: nn.Module, kind: str) -> nn.Module:
    """`kind` "matmul": every SelfAttention of `model` attends through the matmul backward (in place; parameters
    untouched). "sdpa" leaves the model as it is."""
    if kind == "matmul":
        for layer in model.modules():
            if isinstance(layer, SelfAttention):
                layer.attend = attend
    return model
