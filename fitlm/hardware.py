"""The device's numbers that MFU and memory reports stand on: peak FLOP/s and peak memory.

A CPU has no datasheet peak, so fitlm measures a square GEMM. One measurement on a busy machine reads
low (other work holds the cores) and would make MFU read high, even above 100%. So the peak is the
best ever measured on this machine for that dtype: each measurement only raises the value cached in
`$FITLM_CACHE_DIR` (default ~/.cache/fitlm) under the host, CPU model, thread count and torch version.
`train.peak_tflops` pins it outright.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import sys
import time
from pathlib import Path

import torch

from fitlm.atomic import atomic_file
from fitlm.host_allocator import glibc

# Dense half-precision peaks in TFLOP/s (vendor datasheets; see ../shared/REFERENCES.md).
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "4090": 165.0, "3090": 71.0, "L40S": 362.0}

_measured_peaks: dict[str, float] = {}  # this process's measurements, by device and dtype


def device_peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None) -> float:
    """Peak FLOP/s to measure MFU against: the user's number, a known GPU's datasheet, or the best CPU GEMM
    measured on this machine (this process's measurement raises the cached best, never lowers it)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    measured = measure_gemm_flops(device, dtype)
    if device.type != "cpu":
        return measured
    return remember_peak(f"{device.type}:{dtype}", measured)


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


def forget_measured_peaks(device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
    """Drop this process's cached GEMM measurement for `device` and `dtype` (all of them when not given), so the
    next `measure_gemm_flops` times the GEMM again."""
    if device is None or dtype is None:
        _measured_peaks.clear()
    else:
        _measured_peaks.pop(f"{device}:{dtype}", None)


def cache_root() -> Path:
    """Where fitlm keeps what it measured or built for this machine: $FITLM_CACHE_DIR, default ~/.cache/fitlm."""
    return Path(os.environ.get("FITLM_CACHE_DIR") or Path.home() / ".cache" / "fitlm")


def peak_cache_path() -> Path:
    return cache_root() / "peak_flops.json"


def machine_key(what: str) -> str:
    """The cache key of a measurement: what was measured, on which host, CPU, thread count and torch."""
    cpu = platform.processor() or platform.machine()
    return f"{socket.gethostname()}|{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}|{what}"


def remember_peak(what: str, measured: float) -> float:
    """The larger of `measured` and the best cached for this machine; the cache keeps the larger.

    An unwritable or damaged cache only loses the memory of earlier runs, never the run."""
    path, key = peak_cache_path(), machine_key(what)
    try:
        cached = json.loads(path.read_text())
        if not isinstance(cached, dict):
            cached = {}
    except (OSError, ValueError):
        cached = {}
    before = float(cached.get(key, 0.0) or 0.0)
    if measured <= before:
        return before
    cached[key] = measured
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:  # ranks starting together each replace the whole file
            tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
    except OSError:
        pass
    return measured


def mfu_warning(mfu: float, device: torch.device) -> str | None:
    """What to say when MFU reads above 100%: the peak it is measured against was underestimated."""
    if mfu <= 1.0:
        return None
    where = (
        "the CPU GEMM peak measured at start-up was low (the machine was busy)"
        if device.type == "cpu"
        else "this device's datasheet peak is not known to fitlm"
    )
    return (
        f"MFU reads {mfu:.0%}, above 100%: {where}, so MFU is overstated; set train.peak_tflops to the "
        "device's dense peak in TFLOP/s"
    )


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on CUDA; on CPU the process's peak resident set (`fitlm profile` measures peak live
    tensor bytes by category, fitlm.memory.tracking, which is too slow to run on every training step)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def host_peak_rss() -> int:
    """This process's peak resident set in bytes since it started or since `reset_host_peak` (Linux VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_memory_bytes(torch.device("cpu"))


def available_host_memory() -> int | None:
    """Bytes this process may still allocate on the host: the kernel's MemAvailable, or less where a cgroup
    (a container's memory limit) leaves less; None where neither can be read (not Linux)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def reset_host_peak() -> bool:
    """Restart the peak resident set from the current one (Linux clear_refs); False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def return_freed_host_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's malloc_trim). Freed tensors below glibc's
    mmap threshold stay in the process's heap, and count in its resident set, until trimmed: after the
    load's transients and after the training state is released, that is gigabytes on a large model."""
    libc = glibc()
    if libc is not None:  # not glibc (macOS, musl): nothing to do
        libc.malloc_trim(0)
