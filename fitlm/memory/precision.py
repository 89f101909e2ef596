"""Precision levels (memory.mixed_precision), applied around an unmodified model.

    O0  fp32 parameters, gradients, optimizer states and compute.
    O1  fp32 parameters, gradients and optimizer states; matmuls under autocast in half_dtype
        (element-wise ops stay fp32, so activations are a mix).
    O2  fp32 parameters (the master copy), gradients and optimizer states; every op computes in
        half_dtype: each module casts its own parameters to half as it runs, so activations are half
        and the backward of the cast delivers fp32 gradients to the fp32 parameters. Under ZeRO-2/3
        the same is FSDP2's MixedPrecisionPolicy (half all-gathered parameters, fp32 reduce-scatter).
    O3  everything half: parameters, gradients, optimizer states and compute.

Losses are always reduced in fp32 (fitlm.models.loss). fp16 needs loss scaling (fitlm.memory.loss_scale).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from fitlm.config import MemoryConfig
from fitlm.memory.nf4 import is_nf4

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def half_dtype(cfg: MemoryConfig) -> torch.dtype:
    return HALF_DTYPES[cfg.half_dtype]


def compute_dtype(cfg: MemoryConfig) -> torch.dtype:
    """The dtype matmuls run in, which is the dtype MFU is measured against."""
    return torch.float32 if cfg.mixed_precision == "O0" else half_dtype(cfg)


def uses_loss_scaling(cfg: MemoryConfig) -> bool:
    return cfg.mixed_precision != "O0" and cfg.half_dtype == "fp16"


def autocast(cfg: MemoryConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """O1's autocast region; the other levels compute in their parameters' (or cast parameters') dtype."""
    if cfg.mixed_precision != "O1":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=half_dtype(cfg))


def fsdp_mixed_precision(cfg: MemoryConfig):
    """FSDP2's policy for this level: O2 gathers half parameters and reduces gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.mixed_precision == "O2":
        return MixedPrecisionPolicy(param_dtype=half_dtype(cfg), reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def recasts_in_backward(
    level: str, recompute: str, compiled: bool, sharded: bool, tensor_parallel: int, offload: bool = False
) -> bool:
    """Whether O2's half weight casts are made again in backward instead of being kept from forward
    (2 bytes per parameter less during backward, for one more cast of each weight).

    Only where nothing else hooks the saved tensors: recompute (torch.utils.checkpoint) and compile
    take them over, FSDP2 casts by its own policy, tensor-parallel weights are DTensors, and activation
    offload (`offload`: memory.activation_offload is on) hooks each block, where the recast's own per-Linear
    hooks, innermost, would keep the Linears' inputs on the device."""
    return (
        level == "O2" and recompute == "none" and not compiled and not sharded and tensor_parallel == 1 and not offload
    )


def apply_precision(model: nn.Module, cfg: MemoryConfig, sharded: bool, tensor_parallel: int = 1) -> nn.Module:
    """Set up the level's storage and compute dtypes. Apply after tensor parallel, before recompute
    (so a recomputed block casts again rather than keeping half copies alive) and before data parallel.

    `sharded`: ZeRO-2/3 will wrap the model with FSDP2, whose policy does O2's casting instead.
    """
    if cfg.mixed_precision == "O3":
        return model.to(half_dtype(cfg))
    if cfg.mixed_precision == "O2" and not sharded:
        dtype = half_dtype(cfg)
        recast = recasts_in_backward(
            "O2", cfg.recompute, cfg.compile, sharded, tensor_parallel, offload=cfg.activation_offload is not False
        )
        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                _cast_own_parameters(module, dtype, recast)
    return model


def cast_left_out(modules: list[nn.Module], cfg: MemoryConfig) -> None:
    """O2 for the modules of a ZeRO-2/3 model that FSDP2 leaves out, whose policy casts only what it shards
    (expert parallel's experts without replicas to shard them over): each casts its own parameters to half as it
    runs, as `apply_precision` casts an unsharded model's, so they compute as the half activations arriving."""
    if cfg.mixed_precision == "O2":
        for module in modules:
            _cast_own_parameters(module, half_dtype(cfg))


class _Recast:
    """What a saved half weight is packed into: the fp32 parameter and the view to rebuild (no bytes held)."""

    __slots__ = ("param", "dtype", "size", "stride", "offset")

    def __init__(self, param: torch.Tensor, dtype: torch.dtype, view: torch.Tensor):
        self.param, self.dtype = param, dtype
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()


def _pack(casts: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype, t: torch.Tensor):
    """A tensor autograd saves: one of this module's half weight casts (or a view of one) is replaced by
    a recipe to cast it again; anything else is kept as it is."""
    base = t if t._base is None else t._base
    hit = casts.get(id(base))
    if hit is None or hit[0] is not base:
        return t
    return _Recast(hit[1], dtype, t)


def _unpack(saved):
    if not isinstance(saved, _Recast):
        return saved
    # The same cast of the same fp32 values: bit-identical to the half weight forward used.
    return saved.param.detach().to(saved.dtype).as_strided(saved.size, saved.stride, saved.offset)


def _cast_own_parameters(module: nn.Module, dtype: torch.dtype, recast: bool = False) -> None:
    """Run `module.forward` with its own parameters replaced by half casts of them.

    The cast is part of the autograd graph, so the fp32 parameter receives an fp32 gradient and the
    optimizer, DDP, tensor parallel and checkpoints all keep seeing the one fp32 parameter. Only the
    module's direct parameters are cast, each right before it is used, so at most one half copy of
    a weight exists beyond what backward saves anyway. With `recast` (see recasts_in_backward) backward
    does not keep even that: the matmuls' saved half weights are packed as "cast the parameter again".
    """
    inner = module.forward
    # NF4 codes stay as they are: F.linear dequantizes them to the input's dtype (a cast would dequantize
    # the weight and keep the full-width copy for backward).
    names = [name for name, p in module.named_parameters(recurse=False) if not is_nf4(p)]

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        originals = {name: module._parameters[name] for name in names}
        casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(half cast) -> (cast, fp32 parameter)
        try:
            for name, p in originals.items():
                cast = p.to(dtype)
                module._parameters[name] = cast
                if recast and cast is not p:  # a weight stored in half already (frozen at O2) is saved as is
                    casts[id(cast)] = (cast, p)
            if not casts:
                return inner(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, casts, dtype), _unpack):
                return inner(*args, **kwargs)
        finally:
            module._parameters.update(originals)
            # autograd keeps the pack hook (and so this dict) with every tensor it saved: let go of the casts.
            casts.clear()

    module.forward = forward
