"""Device catalog: datasheet memory, dense bf16 peak, HBM and link bandwidth; `cpu` is measured here.

Why a table and not a query: a plan is made before (and usually away from) the hardware it is for.
Numbers are the vendors' datasheet values (dense, no sparsity) unless noted; link bandwidth is the
per-device, one-direction figure a ring collective can use inside a node (NVLink, HCCS or PCIe), and
`inter_node_gbs` the per-device network share (one NIC per device). `efficiency` is the fraction of
peak a well-tuned dense transformer step reaches (MFU-like); `fitlm plan --efficiency` overrides it,
e.g. with the MFU that `fitlm profile` measured on that device.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int  # datasheet capacity
    tflops: float  # dense bf16 (fp32 for `cpu`) peak, TFLOP/s
    hbm_gbs: float  # device memory bandwidth, GB/s
    link_gbs: float  # intra-node collective bandwidth per device, one direction, GB/s
    inter_node_gbs: float = 25.0  # network bandwidth per device between nodes, GB/s
    node_size: int = 8  # devices that share the fast link
    reserved_bytes: int = 1 * GiB  # runtime context, kernels, allocator slack: not for tensors
    efficiency: float = 0.5  # achieved fraction of peak on a dense transformer step
    source: str = ""
    host_memory_bytes: int = 1 * 10**12  # RAM of one node (node_size devices), fitlm.plan.host checks it
    # A rank's process on the host before any tensor: interpreter, torch, the accelerator runtime's host side
    # (CUDA context, cuBLAS/cuDNN or CANN libraries): about 2-3 GiB resident per GPU process.
    host_runtime_bytes: int = 3 * GiB
    host_source: str = ""
    # Device <-> host copies (activation offload), one direction, GB/s: PCIe 4.0 x16 (~25 usable) unless the
    # catalog knows better (H100/H200 SXM: PCIe 5.0 x16, ~50 usable).
    host_link_gbs: float = 25.0

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes


# Sources: NVIDIA A100 datasheet (312 TFLOP/s bf16, 1,555/2,039 GB/s, NVLink3 600 GB/s bidirectional);
# H100 SXM datasheet (989 TFLOP/s dense bf16, 3.35 TB/s, NVLink4 900 GB/s bidirectional); H200 datasheet
# (141 GB, 4.8 TB/s, H100 compute); Ada whitepaper (RTX 4090: 165 TFLOP/s bf16 dense with fp32 accumulate,
# 1,008 GB/s); Ampere GA102 whitepaper (RTX 3090: 71 TFLOP/s fp16 tensor dense, 936 GB/s); consumer cards
# talk over PCIe 4.0 x16 (~25 GB/s usable one way); Huawei Atlas 800T A2 (Ascend 910B: 64 GB HBM,
# ~313 TFLOP/s fp16 -- varies by SKU --, HCCS ~196 GB/s one way, 200 Gb/s RoCE per NPU).
# Host RAM per node (node_size devices): DGX A100 320 GB 1 TB, DGX A100 640 GB 2 TB, DGX H100 / H200 2 TB (NVIDIA
# DGX user guides); consumer cards: a typical 8-GPU RTX server, 256 GB (configurations vary); Atlas 800T A2 as
# commonly configured, 1 TB. `fitlm plan --host-memory` sets yours.
_TB = 10**12
CATALOG: dict[str, Device] = {
    d.name: d
    for d in [
        Device(
            "a100-40g",
            40 * GiB,
            312.0,
            1555.0,
            300.0,
            25.0,
            source="NVIDIA A100 datasheet",
            host_memory_bytes=1 * _TB,
            host_source="DGX A100 320 GB: 1 TB",
        ),
        Device(
            "a100-80g",
            80 * GiB,
            312.0,
            2039.0,
            300.0,
            25.0,
            source="NVIDIA A100 datasheet",
            host_memory_bytes=2 * _TB,
            host_source="DGX A100 640 GB: 2 TB",
        ),
        Device(
            "h100-80g",
            80 * GiB,
            989.0,
            3350.0,
            450.0,
            50.0,
            efficiency=0.45,
            source="NVIDIA H100 SXM datasheet",
            host_memory_bytes=2 * _TB,
            host_source="DGX H100: 2 TB",
            host_link_gbs=50.0,
        ),
        Device(
            "h200",
            141 * 10**9,
            989.0,
            4800.0,
            450.0,
            50.0,
            efficiency=0.45,
            source="NVIDIA H200 datasheet",
            host_memory_bytes=2 * _TB,
            host_source="DGX H200: 2 TB",
            host_link_gbs=50.0,
        ),
        Device(
            "rtx4090",
            24 * GiB,
            165.0,
            1008.0,
            25.0,
            3.0,
            node_size=8,
            source="NVIDIA Ada whitepaper",
            host_memory_bytes=256 * 10**9,
            host_source="an 8-GPU RTX server, 256 GB (typical; set --host-memory)",
        ),
        Device(
            "rtx3090",
            24 * GiB,
            71.0,
            936.0,
            25.0,
            3.0,
            node_size=8,
            source="NVIDIA GA102 whitepaper",
            host_memory_bytes=256 * 10**9,
            host_source="an 8-GPU RTX server, 256 GB (typical; set --host-memory)",
        ),
        Device(
            "ascend-910b",
            64 * GiB,
            313.0,
            1600.0,
            196.0,
            25.0,
            efficiency=0.4,
            source="Huawei Atlas 800T A2",
            host_memory_bytes=1 * _TB,
            host_source="Atlas 800T A2, 1 TB (as commonly configured)",
        ),
    ]
}


def this_host_ram() -> int:
    """This machine's RAM (MemTotal of /proc/meminfo; the physical pages where that file does not exist)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_cpu_cache: dict[str, Device] = {}


def measure_cpu() -> Device:
    """This machine: physical RAM, a best-of-5 fp32 GEMM (well under a second) and a large copy."""
    if "cpu" not in _cpu_cache:
        import torch

        from fitlm.hardware import measure_gemm_flops

        flops = measure_gemm_flops(torch.device("cpu"), torch.float32, n=512)
        a = torch.empty(64 * 2**20 // 4)
        b = torch.empty_like(a)
        b.copy_(a)
        t0 = time.perf_counter()
        b.copy_(a)
        bw = 2 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9  # read + write
        memory = this_host_ram()
        # Processes on one host exchange through shared memory (gloo): about a memory copy's speed. A CPU rank's
        # process (interpreter, torch, fitlm) is ~0.4 GiB resident before its tensors (measured by fitlm profile).
        _cpu_cache["cpu"] = Device(
            "cpu",
            memory,
            flops / 1e12,
            bw,
            bw / 2,
            bw / 2,
            node_size=10**6,
            reserved_bytes=int(0.1 * memory),
            efficiency=0.6,
            source="measured on this machine (fp32 GEMM, memory copy)",
            host_memory_bytes=memory,
            host_runtime_bytes=GiB // 2,
            host_source="this machine (/proc/meminfo)",
        )
    return _cpu_cache["cpu"]


def get_device(
    name: str | None = None,
    memory: str | None = None,
    tflops: float | None = None,
    bandwidth: float | None = None,
    efficiency: float | None = None,
    host_memory: str | None = None,
) -> Device:
    """A catalog device (default a100-80g), with any custom number from the flags replacing its own. A custom
    device is taken to be in this machine (its RAM is the host's) unless `host_memory` says otherwise."""
    if name == "cpu":
        dev = measure_cpu()
    elif name is None and memory is not None and tflops is not None:
        dev = Device(
            "custom",
            parse_bytes(memory),
            tflops,
            2000.0,
            bandwidth or 100.0,
            source="command-line flags",
            host_memory_bytes=this_host_ram(),
            host_source="this machine (/proc/meminfo)",
        )
    elif name is None:
        dev = CATALOG["a100-80g"]
    elif name in CATALOG:
        dev = CATALOG[name]
    else:
        raise DeviceError(
            f"--device {name!r} is not in the catalog; use one of {', '.join([*CATALOG, 'cpu'])}, "
            "or give --device-memory and --device-tflops for any other device"
        )
    return with_flags(dev, memory, tflops, bandwidth, efficiency, host_memory)


def with_flags(
    dev: Device,
    memory: str | None = None,
    tflops: float | None = None,
    bandwidth: float | None = None,
    efficiency: float | None = None,
    host_memory: str | None = None,
) -> Device:
    """`dev` with any number the command line gives replacing its own."""
    changes: dict = {}
    if memory is not None:
        changes["memory_bytes"] = parse_bytes(memory)
    if tflops is not None:
        changes["tflops"] = float(tflops)
    if bandwidth is not None:
        changes["link_gbs"] = float(bandwidth)
    if efficiency is not None:
        changes["efficiency"] = float(efficiency)
    if host_memory is not None:
        changes["host_memory_bytes"] = parse_bytes(host_memory, "--host-memory")
        changes["host_source"] = "--host-memory"
    return replace(dev, **changes) if changes else dev


class DeviceError(ValueError):
    """A device name or number the planner cannot use."""


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """'80GiB', '40GB', '24g', '1e9' -> bytes (GB = 10^9, GiB = 2^30)."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        raise DeviceError(f"{flag} {text!r}: write a size such as 80GiB, 40GB or 24e9")
    return int(float(num) * _UNITS[unit])
