"""Hold the measured burst against `fitlm plan` for the same config: both engines' per-device bytes and
the planned speed, with the error of each engine against the measurement.

Error = planned / measured - 1 (positive: the planner over-estimates). The measured side is the most
loaded rank's peak live tensor bytes (MemTracker), which is what both planner engines predict. A
storage tracker cannot tell logits from other activations, so the planned `activations` are compared
with the analytic engine's activations + logits.
"""

from __future__ import annotations

from typing import Any

from fitlm.config import Config

COMPONENTS = ("params", "grads", "optimizer", "activations", "other", "total")


def error(planned: float | None, measured: float | None) -> float | None:
    if planned is None or not measured:
        return None
    return planned / measured - 1.0


def comparable(per_device: dict[str, int]) -> dict[str, int]:
    """A plan's components with logits folded into activations, as a storage tracker sees them."""
    out = {k: int(per_device.get(k, 0)) for k in COMPONENTS}
    out["activations"] += int(per_device.get("logits", 0))
    return out


def plan_device(device: str, peak_flops: float):
    """The planner's device for the measured one: this CPU as `fitlm plan --device cpu` measures it, or a
    GPU with the trainer's peak and its memory."""
    from fitlm.plan.devices import get_device

    if device.startswith("cuda"):
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
        return get_device(None, f"{memory}B", peak_flops / 1e12)
    return get_device("cpu")


def plan_for(cfg: Config, device: str, peak_flops: float, simulate: bool = True) -> dict[str, Any]:
    """Both engines' per-device bytes and the throughput model's step time for `cfg` (no process group may exist)."""
    from fitlm.plan.analytic import breakdown
    from fitlm.plan.setup import from_config, on_device
    from fitlm.plan.throughput import timing

    dev = plan_device(device, peak_flops)
    s = on_device(from_config(cfg), dev.name)  # on a CPU, activation offload moves nothing
    mem = breakdown(s)
    t = timing(s, dev)
    out: dict[str, Any] = {
        "analytic": {"per_device": mem.as_dict(), "peak_phase": mem.phase},
        "timing": {
            "device": dev.name,
            "tflops": dev.tflops,
            "efficiency": dev.efficiency,
            "step_time_s": t.step_s,
            "tokens_per_s": t.tokens_per_s,
            "mfu": t.mfu,
        },
    }
    if simulate:
        from fitlm.plan.simulate import SimulationUnsupported, run_step

        try:
            out["simulated"] = {"per_device": run_step(cfg)}
        except SimulationUnsupported as exc:
            out["simulated"] = {"error": str(exc)}
    return out


def hold_against(measured: dict[str, int] | None, plan: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Error of each engine per component (None where not measured or not simulated)."""
    out = {}
    for engine in ("analytic", "simulated"):
        per_device = plan.get(engine, {}).get("per_device")
        if per_device is None or measured is None:
            continue
        planned = comparable(per_device)
        out[engine] = {k: error(planned[k], measured.get(k)) for k in COMPONENTS}
    return out
