"""LoRA adapters sharded with their base Linear under tensor parallel (`fitlm.parallel.tensor_parallel`).

A LoRA Linear computes y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with W [out, in], A [r, in], B [out, r]. Each adapter
matrix is split the way that keeps the adapter's path as local as the base's:

- column-parallel base (W sharded on `out`: q/k/v, gate/up): A is replicated, so every rank computes the
  same [.., r] activation, and B is sharded on `out` like W, so the rank's output slice [.., out/tp]
  gets exactly its slice of the update. No communication in forward; A's gradient is a partial sum
  (each rank saw its own output columns) that stays Partial through backward and accumulation: DTensor
  all-reduces it where it is read (clipping, the optimizer step; measured with CommDebugMode: about three
  all-reduces per such gradient per step under foreach AdamW -- small, [r, in], but a reduction once per
  step would do).
- row-parallel base (W sharded on `in`: o, down): A is sharded on `in` like W, so x·Aᵀ is a partial
  sum [.., r] on each rank, and B is replicated. The adapter's partial output is added to the base's
  partial output *before* the style's one all-reduce (reduce-scatter under sequence parallel), so
  the sum over ranks is taken exactly once for both together.

torch's Colwise/RowwiseParallel distribute every parameter of the module and its children alike (and
refuse the children's dotted names); these styles give each of W, A and B its own placement. The
LoRA forward hook runs between the style's input and output hooks, so it sees the DTensor input and
the DTensor (sharded or partial) base output and needs no change.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

# submodule name within the adapted Linear ("" = the Linear itself) -> parameter name -> placement
Placements = dict[str, dict[str, Placement]]

COLWISE: Placements = {
    "": {"weight": Shard(0), "bias": Shard(0)},  # W [out/tp, in], bias [out/tp]
    "lora_A": {"weight": Replicate()},  # A [r, in]
    "lora_B": {"weight": Shard(0)},
}  # B [out/tp, r]
ROWWISE: Placements = {
    "": {"weight": Shard(1), "bias": Replicate()},  # W [out, in/tp]; bias added once
    "lora_A": {"weight": Shard(1)},  # A [r, in/tp]
    "lora_B": {"weight": Replicate()},
}  # B [out, r]


def _distribute_own(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank: int | None
) -> None:
    # Only the module's own parameters: the adapter's children get theirs when distribute_module reaches them.
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(
            name,
            nn.Parameter(
                distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank),
                requires_grad=param.requires_grad,
            ),
        )


class LoraColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear with a LoRA adapter: W and B sharded on `out`, A replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute_own(module, device_mesh, COLWISE[name], self.src_data_rank)


class LoraRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a Linear with a LoRA adapter: W and A sharded on `in`, B replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute_own(module, device_mesh, ROWWISE[name], self.src_data_rank)


def has_adapter(module: nn.Module) -> bool:
    """A Linear that `fitlm.finetune.lora.add_lora` gave an adapter (`lora.is_adapted`, which this layer
    cannot import: finetune and parallel are one layer)."""
    return isinstance(module, nn.Linear) and hasattr(module, "lora_A")
