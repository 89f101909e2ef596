"""Give a model that was built on the meta device and then parallelized its weights, this rank's share only.

Why: building (or loading) the whole fp32 model on every rank before sharding it costs each rank the
whole model in host memory first -- a 7B model needs ~28 GB per rank before ZeRO-3 or tensor
parallel can help. So the trainer builds on meta (no storage), lets `fitlm.parallel.apply` split and
shard it as usual, and only then calls `materialize`: every module gets uninitialised storage for
its own parameters (`to_empty`: FSDP2 allocates the local shards, tensor parallel its slices, a
pipeline stage its blocks), then each full weight arrives once, from a stream that holds one tensor
at a time (`fitlm.models.init_replay` for a seeded initialisation, `fitlm.models.streaming` for
files), and each rank copies out the slice its parameter holds. The values equal the single-process
model's, so every layout still trains exactly as the single process does.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fitlm.memory import nf4
from fitlm.models.hf import strip_wrappers
from fitlm.models.streaming import layer_group


class MaterializeError(ValueError):
    """The weights do not fit the model built from the config (a name or a shape); the message names it."""


def plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model (what the weight streams use). DDP's `module.` never occurs:
    materialize runs before DDP wraps, and the final save's walk unwraps it."""
    return strip_wrappers(name)


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """First name -> the other names of each parameter registered under several (a tied head)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return aliases


def _fill(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Copy this rank's part of the full weight into `param` (a plain tensor or a DTensor of any placement)."""
    # the storage FSDP2 gathers from
    local: torch.Tensor = param._local_tensor if isinstance(param, DTensor) else param
    if (nf4.stored_shape(full.shape) if nf4.is_nf4(local) else tuple(full.shape)) != tuple(param.shape):
        raise MaterializeError(
            f"weight {name}: the weights hold {list(full.shape)} but the model built from the "
            f"config needs {list(param.shape)}; the config does not match the weights"
        )
    if nf4.is_nf4(local):  # QLoRA's 4-bit base: quantized here, this rank's rows kept
        nf4.fill(local, full, *_row_block(param))
        return
    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank has the full tensor, so each slices locally, without communication.
        local = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def _row_block(param: torch.Tensor) -> tuple[int, int]:
    """(row blocks, this rank's block) of a parameter split by rows alone: FSDP2's Shard(0) over dp, expert
    parallel's Shard(0) over ep, or both over (edp, ep) (each ep rank's rows split once more over edp); (1, 0)
    whole. The blocks are even: QLoRA quantizes only weights whose rows divide (fitlm.finetune.qlora)."""
    if not isinstance(param, DTensor):
        return 1, 0
    rows, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.shape[0] // rows[0], offset[0] // rows[0]


@torch.no_grad()
def materialize(
    modules: list[nn.Module],
    weights: Callable[[set[str]], Iterable[tuple[str, torch.Tensor]]],
    device: torch.device | str,
    aliases: dict[str, list[str]] | None = None,
) -> None:
    """Allocate `modules` (this rank's parts, built on meta) on `device` and fill them from
    `weights(groups)`: (plain name, full tensor) pairs, each name once; `groups` are the blocks
    (`fitlm.models.streaming.layer_group`) these modules hold, so a stream may skip the others.
    `aliases`: the other names of tied weights (`tied_aliases` of the unsplit model): a pipeline's last
    stage holds the tied head as its own copy. Raises MaterializeError naming the first weight the
    model has but the stream never gave."""
    aliases = aliases or {}
    targets: dict[str, list[nn.Parameter]] = {}
    for module in modules:
        module.to_empty(device=device)
        for m in module.modules():
            if hasattr(m, "tie_weights"):
                # to_empty gives each registration its own storage: share the tied head again
                m.tie_weights()  # type: ignore[operator]  # (hasattr above)
        seen: set[int] = set()
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                targets.setdefault(plain_name(name), []).append(p)
    filled: set[str] = set()
    back = {alias: name for name, names in aliases.items() for alias in names}
    groups = {layer_group(back.get(n, n)) for n in targets}
    for name, full in weights(groups):
        for n in (name, *aliases.get(name, ())):
            for p in targets.get(n, ()):
                _fill(p, full, n)
                filled.add(n)
    missing = [n for n in targets if n not in filled]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise MaterializeError(
            f"the weights give no value for {', '.join(missing[:3])}{more}; they do not match "
            f"the model built from the config"
        )
    for module in modules:
        for m in module.modules():
            if hasattr(m, "reset_rope"):
                # non-persistent buffers (RoPE tables) are computed, not stored
                m.reset_rope(device)  # type: ignore[operator]  # (hasattr above)
            if hasattr(m, "reset_expert_bias"):  # aux-free balancing's routing bias: zero (a checkpoint restores it)
                m.reset_expert_bias()  # type: ignore[operator]  # (hasattr above)
