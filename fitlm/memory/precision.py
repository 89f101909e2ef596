"""Precision levels (memory.mixed_precision).

O0: fp32 everything. O1: fp32 parameters, gradients and optimizer states; matmuls under autocast in
half_dtype. O2/O3 (half parameters with or without fp32 masters) and fp16 loss scaling arrive with
the memory-optimisations work; until then they are refused by `fitlm.train.preflight`.
"""

from __future__ import annotations

import contextlib

import torch

from fitlm.config import MemoryConfig

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(cfg: MemoryConfig) -> torch.dtype:
    """The dtype matmuls run in, which is the dtype MFU is measured against."""
    return torch.float32 if cfg.mixed_precision == "O0" else HALF_DTYPES[cfg.half_dtype]


def autocast(cfg: MemoryConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.mixed_precision == "O0":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=HALF_DTYPES[cfg.half_dtype])
