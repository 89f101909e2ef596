"""Which device `fitlm plan` plans for, and why.

A plan is a claim about one device. Made on a laptop without --device it used to be an A100's, and its MFU and
"fits" read like this machine's. So the choice is explicit and reported (`device_source` in the JSON, the
report's first line): a --device flag (or custom --device-memory/--device-tflops), the config's
`train.device: cpu`, this machine's CUDA GPU, or the default, named with the flag that changes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fitlm.plan.devices import CATALOG, Device, GiB, get_device, this_host_ram, with_flags

DEFAULT = "a100-80g"


@dataclass(frozen=True)
class LocalGPU:
    """What torch.cuda says of this machine's first GPU."""

    name: str
    memory_bytes: int


def local_gpu() -> LocalGPU | None:
    """This machine's first CUDA GPU, or None (no CUDA build, no driver, no device)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return LocalGPU(props.name, int(props.total_memory))


def catalog_name(gpu: LocalGPU) -> str | None:
    """The catalog entry for a torch.cuda device name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", ...)."""
    name = gpu.name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-80g"
    if "A100" in name:  # two memory sizes under one name
        return "a100-80g" if gpu.memory_bytes > 48 * GiB else "a100-40g"
    for key, entry in (("4090", "rtx4090"), ("3090", "rtx3090")):
        if key in name:
            return entry
    return None


def gpu_device(gpu: LocalGPU) -> Device:
    """A GPU the catalog lacks: its own memory, and its datasheet peak (fitlm.hardware) or a measured GEMM."""
    from fitlm.hardware import GPU_PEAK_TFLOPS

    tflops = next((t for key, t in GPU_PEAK_TFLOPS.items() if key in gpu.name), None)
    if tflops is None:  # no datasheet figure: measure a bf16 GEMM on it (well under a second)
        import torch

        from fitlm.hardware import measure_gemm_flops

        tflops = measure_gemm_flops(torch.device("cuda", 0), torch.bfloat16) / 1e12
    return Device(
        gpu.name,
        gpu.memory_bytes,
        tflops,
        1000.0,  # HBM and link: unknown here; a PCIe card's figures, which only the step-time split reads
        25.0,
        source="this machine's GPU (torch.cuda): its memory; a datasheet peak, else a measured GEMM",
        host_memory_bytes=this_host_ram(),
        host_source="this machine (/proc/meminfo)",
    )


def choose_device(
    name: str | None = None,
    memory: str | None = None,
    tflops: float | None = None,
    bandwidth: float | None = None,
    efficiency: float | None = None,
    host_memory: str | None = None,
    config_device: str = "auto",
    detect: Callable[[], LocalGPU | None] = local_gpu,
) -> tuple[Device, dict[str, Any]]:
    """The device to plan for and `device_source` ({"by": flag|config|local_gpu|default, "note": ...}).
    `config_device` is the config's train.device; `detect` finds this machine's GPU (tests pass their own)."""
    flags: dict[str, Any] = dict(
        memory=memory, tflops=tflops, bandwidth=bandwidth, efficiency=efficiency, host_memory=host_memory
    )
    if name is not None or (memory is not None and tflops is not None):
        dev = get_device(name, **flags)
        why = f"--device {name}" if name else "--device-memory and --device-tflops"
        return dev, _source(dev, "flag", why, flags)
    if config_device == "cpu":
        dev = get_device("cpu", **flags)
        return dev, _source(dev, "config", "the config's train.device: cpu; --device NAME plans for another", flags)
    gpu = detect()
    if gpu is not None:
        known = catalog_name(gpu)
        dev = with_flags(CATALOG[known] if known else gpu_device(gpu), **flags)
        catalog = f"its catalog entry; --device {known}" if known else "not in the catalog"
        why = f"this machine's GPU: {gpu.name}, {gpu.memory_bytes / GiB:.0f} GiB, {catalog}"
        return dev, _source(dev, "local_gpu", why + "; --device NAME plans for another", flags)
    dev = get_device(DEFAULT, **flags)
    cuda = "train.device: cuda but" if config_device == "cuda" else "no --device given and"
    why = f"default: {cuda} no GPU here; pass --device cpu or --device NAME"
    return dev, _source(dev, "default", why, flags)


FLAG_NAMES = {"memory": "--device-memory", "tflops": "--device-tflops", "bandwidth": "--device-bandwidth",
              "efficiency": "--efficiency", "host_memory": "--host-memory"}  # fmt: skip


def _source(dev: Device, by: str, why: str, flags: dict[str, Any]) -> dict[str, Any]:
    changed = [FLAG_NAMES[k] for k, v in flags.items() if v is not None]
    extra = f"; {', '.join(changed)} from the command line" if changed and by != "flag" else ""
    return {"by": by, "note": f"planned for {dev.name} ({why}{extra})"}


__all__ = ["LocalGPU", "catalog_name", "choose_device", "gpu_device", "local_gpu"]
