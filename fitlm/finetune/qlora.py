"""QLoRA: LoRA adapters on a frozen base whose linear layers are stored in 4-bit NF4 (`fitlm.memory.nf4`).

Every Linear LoRA may target (all of them but the output head, PEFT's `all-linear` set) is quantized,
targeted or not, as QLoRA does; embeddings, norms, biases and the head keep the frozen base's storage
(half under O2). It runs on the meta model after `inject_lora` and before any wrapper, so FSDP2 shards
the 4-bit codes and `fitlm.parallel.materialize` quantizes each weight as it streams past.

A weight whose shard would split a double-quantization group (`nf4.scaler_block` is None: a dimension
that is not a multiple of 64 × 64 / shards, say) stays in the base's dtype; `quantize_base` names them.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from fitlm.finetune.lora import candidate_linears
from fitlm.memory import nf4


def quantize_base(model: nn.Module, shards: int = 1) -> list[str]:
    """Store the frozen candidate Linears' weights of `model` (on meta) as NF4 parameters whose rows split evenly
    into `shards` (the ZeRO-2/3 degree, 1 otherwise). Returns the Linears left unquantized."""
    kept: list[str] = []
    quantized: list[str] = []
    for name, linear in candidate_linears(model).items():
        w = linear.weight
        if w.requires_grad:
            continue
        scaler = nf4.scaler_block(tuple(w.shape), shards)
        if scaler is None:
            kept.append(name)
            continue
        linear.weight = nf4.quantized_meta(w, scaler)
        quantized.append(f"{name}.weight")
    # DDP broadcasts every parameter at construction and cannot pack NF4 codes; frozen, they need no sync
    # (each rank quantizes the same full weights).
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(quantized)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(ignored))
    return kept
