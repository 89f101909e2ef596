"""Generic tensor-parallel styles the block plans are made of (fitlm.parallel.tensor_parallel, and the split
experts' style in fitlm.parallel.expert_tensor_parallel): replicated parameters with a layout change around them,
and a layout change of a module's first argument only."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the mesh (as DTensors); the input is read as `input_layout` and the
    output redistributed to `output_layout`, then returned as a local tensor.

    Used for the norms without sequence parallel and for gpt2's position embedding: their gradients
    are then DTensors like every other one, and their placement bookkeeping is done by DTensor.
    """

    def __init__(self, input_layout: Placement, output_layout: Placement):
        self.input_layout, self.output_layout = input_layout, output_layout

    def _input_fn(self, mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        return (x, *inputs[1:])

    def _output_fn(self, mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        if out.placements != (self.output_layout,):
            out = out.redistribute(placements=(self.output_layout,))
        return out.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # partition_fn=None: every parameter becomes a Replicate DTensor (broadcast from rank 0).
        # (torch types input_fn/output_fn as returning None, though it uses what they return)
        return distribute_module(module, device_mesh, None, self._input_fn, self._output_fn)  # type: ignore[arg-type]


class FirstArgLayout(ParallelStyle):
    """PrepareModuleInput for the first positional argument only: the activation, read as `src`,
    is redistributed to `dst` (Shard(1) -> Replicate is the sequence all-gather of SP).

    The other arguments (rotary cos/sin, the KV cache, positional or keyword) pass untouched,
    whatever their number, which differs between families. By default the activation stays a
    DTensor, so the gradients of q/k/v (gate/up) add up as partial sums and are reduced once.
    """

    def __init__(self, src: Placement, dst: Placement, to_local: bool = False):
        self.src, self.dst, self.to_local = src, dst, to_local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (self.src,), run_check=False)
            if x.placements != (self.dst,):
                x = x.redistribute(placements=(self.dst,))
            return (x.to_local() if self.to_local else x, *args[1:])

        module.register_forward_pre_hook(hook)
        return module
