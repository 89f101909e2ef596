"""A model's seeded initial weights one module at a time, equal to building it whole on the CPU.

`registry.build_model(cfg)` after `torch.manual_seed(seed)` draws every weight from the global
generator: first each module's constructor (`reset_parameters`: Kaiming for a Linear, normal for an
Embedding), then `init_weights` over `modules()`. A sharded run builds on the meta device (no draws,
no memory) and needs the same values, but only its own slices of them. Replaying the same draws on
a CPU copy of one module at a time yields them with one module's weights in memory, and leaves the
generator where a whole-model build leaves it (so what draws next, such as LoRA's initialisation,
draws the same numbers). tests/unit/test_materialize.py checks both for every family.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Iterator, cast

import torch
import torch.nn as nn

from fitlm import registry
from fitlm.config import ModelConfig

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM


def cpu_copy(module: nn.Module) -> nn.Module:
    """A CPU copy of a meta module, storage allocated and uninitialised."""
    return copy.deepcopy(module).to_empty(device="cpu")


def _leaves_with_weights(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if not list(m.children()) and next(m.parameters(recurse=False), None) is not None
    ]


def seeded_weights(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight `build_model(cfg)` gives after `torch.manual_seed(seed)`, one module
    at a time (a tied head is left out: it is the embedding). Seeds the global generator when iterated."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cast("CausalLM", registry.build_model(cfg))  # (a registered family's model)
    leaves = _leaves_with_weights(model)
    with torch.no_grad():
        for _, module in leaves:  # the constructors' draws, in construction order
            if hasattr(module, "reset_parameters"):
                cpu_copy(module).reset_parameters()  # type: ignore[operator]  # (hasattr above)
        head = getattr(model, "lm_head", None)
        for name, module in leaves:  # then init_weights' draws, which set the values
            tied_head = module is head and cfg.tie_embeddings
            if tied_head and cast(nn.Linear, head).bias is None:  # (tied_head: head is this module)
                continue  # nothing of its own; init_weights draws nothing for it either
            local = cpu_copy(module)
            model.init_leaf(local, tied_head=tied_head)
            for pname, p in local.named_parameters(recurse=False):
                if not (tied_head and pname == "weight"):
                    yield f"{name}.{pname}", p.detach()
