"""memory.attention_backward (applied from outside the model, like the other memory options): `matmul` and
`matmul_saved` point every attention layer's `attend` at one of fitlm.models.matmul_attention's blocked matmul
attentions on CPU. Context parallel sets its own `attend` instead (fitlm.rules refuses both)."""

from __future__ import annotations

import torch.nn as nn

from fitlm.models.layers import SelfAttention
from fitlm.models.matmul_attention import attend, attend_saved

ATTENDS = {"matmul": attend, "matmul_saved": attend_saved}


def apply_attention_backward(model: nn.Module, kind: str) -> nn.Module:
    """`kind` "matmul" or "matmul_saved": every SelfAttention of `model` attends through that blocked matmul
    attention (in place; parameters untouched). "sdpa" leaves the model as it is."""
    if kind in ATTENDS:
        for layer in model.modules():
            if isinstance(layer, SelfAttention):
                layer.attend = ATTENDS[kind]
    return model
