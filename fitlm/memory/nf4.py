"""Frozen weights stored as 4-bit NormalFloat with double quantization (QLoRA, Dettmers et al. 2023).

The storage is torchao's `NF4Tensor`: per 64 weights one absmax scale, the scales themselves quantized
to int8 in groups of `scaler_block` with one bf16 factor per group (4.126 bits per weight, 0.258× bf16).
`F.linear` on it dequantizes to the input's dtype in forward and again in backward, so the only
full-width copy of a weight lives for one matmul.

Why torchao and not bitsandbytes (measured, docs/finetuning.md): torchao's tensor runs on CPU and CUDA
and implements FSDP2's all-gather extension, so ZeRO-3 shards the 4-bit codes and two ranks train as one
process does; bitsandbytes' `Params4bit` loses its `quant_state` under `fully_shard`.

Stacked MoE experts [E, out, in] are one NF4 tensor stored 2-D as [E·out, in] (the same flat order); each
expert's weights are whole blocks and whole groups (`stacked_scaler_block`), so `expert` hands out expert e's
codes as a 2-D NF4 tensor without a copy, dequantized for its matmuls alone. 2-D because torchao's NF4 splits
and gathers (FSDP2's dim-0 chunks) only 1-D and 2-D tensors: under ZeRO-2/3 each rank holds E/shards whole
experts' rows, gathered per block like a Linear's (fitlm.models.experts.GroupedExperts.stacked_shape reads them back
as [E, out, in]); under expert parallel each ep rank's E/ep experts' rows (a DTensor Shard(0) over "ep"), split
once more over their edp replicas under ZeRO-2/3.

A weight is quantized on the meta device (`quantized_meta`, before any wrapper), sharded by FSDP2 like any
other parameter, and filled when `fitlm.parallel.materialize` streams the full weight past it (`fill`):
the full tensor is quantized on every rank (the double quantization's mean is a whole-tensor statistic)
and each rank keeps its rows' codes, so every layout holds the numbers one process holds.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from torchao.quantization import NF4Tensor  # untyped: Any to mypy

BLOCK = 64  # weights per absmax scale (QLoRA's block size)
SCALER_BLOCKS = (256, 128, 64)  # scales per double-quantization group, tried largest first (QLoRA: 256)
STORED_DTYPE = torch.bfloat16  # what the codes dequantize from (`get_original_weight`); F.linear casts on


class NF4Unavailable(ImportError):
    """torchao is not installed; the message names the extra to install."""


def _nf4():
    # torchao logs a warning per CUDA/mxfp8 kernel library it cannot load (none apply to NF4 on a CPU build),
    # and torch one for an enum it registers: quiet during the import only.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError as e:
        raise NF4Unavailable(
            "finetune.method: qlora stores the frozen base in 4-bit NF4 through torchao, which "
            "is not installed: pip install 'fitlm[qlora]' (torchao 0.18)"
        ) from e
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    _gather_into_dtensors(NF4Tensor)
    return NF4Tensor, to_nf4


def _gather_into_dtensors(cls) -> None:
    """Let FSDP2 gather NF4 codes into a DTensor parameter again (expert parallel's experts sharded over their edp
    replicas too: a DTensor over "ep" whose local codes FSDP2 shards). From the second all-gather on, FSDP2 hands
    `fsdp_post_all_gather` the unsharded parameter as `out`, here that DTensor; torchao 0.18's NF4 asserts an
    NF4Tensor (its float8 and MoE weights take the DTensor's local tensor, as this does). The `out` call only
    checks that the gathered codes are `out`'s storage, so passing the local NF4 tensor changes nothing else."""
    post = cls.fsdp_post_all_gather
    if getattr(post, "_fitlm_dtensor_out", False):
        return
    from torch.distributed.tensor import DTensor

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return post(self, outputs, metadata, param_dtype, out=out.to_local() if isinstance(out, DTensor) else out)

    fsdp_post_all_gather._fitlm_dtensor_out = True  # type: ignore[attr-defined]  # (applied once)
    cls.fsdp_post_all_gather = fsdp_post_all_gather


def is_nf4(t) -> bool:
    """Whether `t` (a plain tensor, or a DTensor's local shard: pass `to_local()`) holds NF4 codes. Never
    imports torchao: a process that has not loaded it holds no NF4 tensor."""
    mod = sys.modules.get("torchao.quantization")
    return mod is not None and isinstance(t, mod.NF4Tensor)


def scaler_block(shape: tuple[int, ...], shards: int = 1) -> int | None:
    """The double-quantization group for a weight of `shape` split by rows into `shards` (FSDP2 shards dim 0),
    or None when it cannot be stored in NF4: it is not 2-D, or a shard's weights are not whole groups (the
    codes of one group must not straddle two ranks)."""
    if len(shape) != 2 or shape[0] % shards:
        return None
    local = shape[0] // shards * shape[1]
    return next((sb for sb in SCALER_BLOCKS if local % (BLOCK * sb) == 0), None)


def stacked_scaler_block(shape: tuple[int, ...], shards: int = 1) -> int | None:
    """The double-quantization group for stacked experts [E, out, in] (fitlm.models.experts.GroupedExperts), stored as
    one NF4 tensor [E·out, in] whose blocks and groups never straddle two experts (each expert's out·in weights
    are whole groups), so expert e's codes are one slice (`expert`), and whose `shards` row blocks (ZeRO-2/3's)
    are whole experts (E divisible by `shards`), so no group straddles two ranks either; None when that cannot
    hold."""
    if len(shape) != 3 or shape[0] % shards:
        return None
    return scaler_block(tuple(shape[1:]))


TABLE_BYTES = 16 * 2 + 2  # per tensor: the 16-entry code table and the scales' mean, in STORED_DTYPE


def nf4_bytes(numel: int, scaler: int = SCALER_BLOCKS[0]) -> float:
    """Bytes of one NF4 weight (or of one rank's rows of it): 4-bit codes, an int8 scale per block of 64, a
    factor per group of scales, and the code table with the mean (all as torchao stores them)."""
    itemsize = STORED_DTYPE.itemsize
    return numel / 2 + numel / BLOCK + itemsize * numel / (BLOCK * scaler) + TABLE_BYTES


def quantized_meta(weight: torch.Tensor, scaler: int, device: str = "meta") -> torch.nn.Parameter:
    """A frozen NF4 parameter with `weight`'s shape and no values: on meta (no storage) for `fill` to give it its
    codes, or on `device` (a planner's fake tensors, under FakeTensorMode)."""
    _, to_nf4 = _nf4()
    empty = torch.empty(stored_shape(weight.shape), dtype=STORED_DTYPE, device=device)
    return torch.nn.Parameter(to_nf4(empty, BLOCK, scaler), requires_grad=False)


def stored_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The shape a weight of `shape` has in NF4: stacked experts [E, out, in] as [E·out, in]; 2-D as is."""
    return (shape[0] * shape[1], shape[2]) if len(shape) == 3 else tuple(shape)


def _rows(full: torch.Tensor) -> torch.Tensor:
    """A stacked weight [E, out, in] as the 2-D [E·out, in] torchao quantizes (the same flat order); 2-D as is."""
    return full.reshape(-1, full.shape[-1]) if full.dim() == 3 else full


def _with(q, **changes):
    """NF4 tensor `q` with some of its fields replaced (torchao's own constructor arguments, so nothing is copied)."""
    args = importlib.import_module(type(q).__module__).construct_nf4_args(q, changes)
    return type(q)(*args)


def expert(t, e: int, count: int):
    """Expert e's weight [out, in] of `count` stacked NF4 experts `t` [count·out, in]: a 2-D NF4 tensor on slices
    of `t`'s codes, scales and factors (no copy; `stacked_scaler_block` keeps each expert's groups whole), which
    F.linear dequantizes for its one matmul, in forward and again in backward (torchao's LinearNF4)."""
    out = t.shape[0] // count
    per = out * t.shape[1]  # weights of one expert
    groups = per // BLOCK  # absmax scales of one expert
    factors = groups // t.scaler_block_size
    return _with(
        t,
        size=torch.Size((out, t.shape[1])),
        stride=(t.shape[1], 1),
        n_blocks=groups,
        quantized_data=t.quantized_data[e * per // 2 : (e + 1) * per // 2],  # two codes a byte
        quantized_scalers=t.quantized_scalers[e * groups : (e + 1) * groups],
        quantization_factor=t.quantization_factor[e * factors : (e + 1) * factors],
    )


@torch.no_grad()
def fill(target, full: torch.Tensor, shards: int = 1, index: int = 0) -> None:
    """Quantize `full` and store the codes of its `index`-th of `shards` row blocks in `target` (an NF4 tensor
    that `to_empty` allocated: its codes, scales and factors have storage, the mean and the code table not)."""
    _, to_nf4 = _nf4()
    rows = _rows(full.to(target.quantized_data.device, STORED_DTYPE))  # [rows, in]
    q = to_nf4(rows, target.block_size, target.scaler_block_size)
    if shards > 1:
        q = q.split(rows.shape[0] // shards)[index]
    for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
        getattr(target, name).copy_(getattr(q, name))
    target.scaler_mean = q.scaler_mean.clone()
    target.nf4 = q.nf4.clone()


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """`t` with NF4 codes turned back into `STORED_DTYPE` weights (a DTensor keeps its placements); any
    other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and is_nf4(t.to_local()):
        return DTensor.from_local(
            cast("NF4Tensor", t.to_local()).get_original_weight(),
            t.device_mesh,
            t.placements,
            shape=t.shape,
            stride=t.stride(),
        )
    return cast("NF4Tensor", t).get_original_weight() if is_nf4(t) else t


@torch.no_grad()
def round_trip(full: torch.Tensor, scaler: int) -> torch.Tensor:
    """`full` as NF4 holds it: quantized (as `fill` quantizes) and dequantized, in fp32 -- what a merge folds
    an adapter into, so the merged model computes what the QLoRA run computed."""
    _, to_nf4 = _nf4()
    return to_nf4(_rows(full.to(STORED_DTYPE)), BLOCK, scaler).get_original_weight().reshape(full.shape).float()
