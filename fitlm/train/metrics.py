"""What a step costs: FLOPs per token, the device's peak, MFU, peak memory, and the metrics writer (JSONL, TensorBoard)."""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from fitlm.config import ModelConfig

# Dense half-precision peaks in TFLOP/s (vendor datasheets; see ../shared/REFERENCES.md).
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "4090": 165.0, "3090": 71.0, "L40S": 362.0}

_measured_peaks: dict[str, float] = {}


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in a matmul per token: everything except embedding lookups.

    The output projection counts (it is a matmul) even when tied to the input embedding.
    """
    # named_parameters() lists a tied weight once, under its first (embedding) name.
    named = dict(model.named_parameters())
    total = sum(p.numel() for n, p in named.items() if not is_embedding(n))
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and "lm_head.weight" not in named:
        total += lm_head.weight.numel()
    return total


def is_embedding(name: str) -> bool:
    return "embed" in name or name.endswith(("wte.weight", "wpe.weight"))


def flops_per_token(model: nn.Module, cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (forward 2N + backward 4N) plus attention 12·L·h·s (PaLM, App. B).

    The attention term is counted in full, not halved for the causal mask, as PaLM and most peers do.
    """
    return 6.0 * matmul_params(model) + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len


def device_peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None) -> float:
    """Peak FLOP/s to measure MFU against: the user's number, a known GPU's datasheet, or a CPU GEMM measurement."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return measure_gemm_flops(device, dtype)


def measure_gemm_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """Best-of-N square GEMM throughput; cached per device and dtype (takes well under a second on CPU)."""
    key = f"{device}:{dtype}"
    if key not in _measured_peaks:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b  # warm-up: first call pays for thread pools / kernel selection
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        _measured_peaks[key] = 2.0 * n**3 / best
    return _measured_peaks[key]


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on CUDA; on CPU the process's peak resident set (`fitlm profile` measures peak live
    tensor bytes by category, fitlm.memory.tracking, which is too slow to run on every training step)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def tensorboard_problem(setting: str | bool) -> str | None:
    """Why `train.tensorboard` cannot be honoured here, or None."""
    if setting is True and not tensorboard_installed():
        return ("train.tensorboard: true, but the tensorboard package is not installed; "
                "`pip install tensorboard`, or set train.tensorboard to auto or false")
    return None


def tensorboard_dir(output_dir: Path, setting: str | bool) -> Path | None:
    """Where TensorBoard event files go for this `train.tensorboard` setting, or None for no TensorBoard."""
    on = setting is True or (setting == "auto" and tensorboard_installed())
    return Path(output_dir) / "tensorboard" if on else None


def scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) of every number in a record; nested dicts become `a/b`, lists `a/0`, `a/1`, ..."""
    for key, value in record.items():
        if key == "step" or isinstance(value, (bool, str)) or value is None:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, tag + "/")
        elif isinstance(value, list):
            yield from scalars({str(i): v for i, v in enumerate(value)}, tag + "/")
        elif isinstance(value, (int, float)):
            yield tag, float(value)


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl; flushed each write so a crash keeps the history.

    With `tensorboard_dir` the same numbers also go to TensorBoard event files there (tags as in
    `scalars`); guard and warning records (those with a `message` or `reason`) become text entries.
    """

    def __init__(self, path: Path, tensorboard_dir: Path | None = None):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in record:
            self._write_tensorboard(record)

    def _write_tensorboard(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        text = record.get("message") or record.get("reason")
        if text:
            kind = record.get("guard") or record.get("warning") or "event"
            self._tb.add_text(f"events/{kind}", f"{text} (action: {record.get('action', 'warn')})", step)
            return
        for tag, value in scalars(record):
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def report(record: dict[str, Any], log) -> None:
    """An intervention or warning: one metrics.jsonl record and one stderr line (main rank only: `log` is None elsewhere)."""
    if log is None:
        return
    log.write(record)
    if "guard" in record:
        text = f"guard: step {record['step']}: {record['reason']}; action: {record['action']} (see {record['see']})"
    else:
        text = f"warning: step {record['step']}: {record['message']}"
    print(f"fitlm: {text}", file=sys.stderr)
