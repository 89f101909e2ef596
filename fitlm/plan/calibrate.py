"""`fitlm plan --calibrate PROFILE.json`: fit the throughput model to a measured burst.

`fitlm profile` records the measured step time beside the plan's prediction for the same config and
device (profile.json: `step_time_s` and `plan.timing` with the device's peak and efficiency). The planned
step is compute / (peak × efficiency) plus the exposed communication, so the rate the device really
sustains is peak × efficiency × planned / measured: exact where compute dominates the step (one device,
or little communication), close otherwise. `fitlm plan` then sets the efficiency of the device it plans
for so that it sustains that rate, for every layout it prices (`--search` included).
"""

from __future__ import annotations

import json
from pathlib import Path


class CalibrationError(ValueError):
    """A profile file that cannot calibrate the planner."""


def sustained_tflops(path: str | Path) -> tuple[float, str]:
    """(TFLOP/s the profiled device sustained, by the throughput model's count; one-line explanation)."""
    path = Path(path)
    if path.is_dir():
        path = path / "profile.json"  # the profile's --out directory
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationError(
            f"--calibrate {path}: no such file; give the profile.json that `fitlm profile` wrote "
            "(or its --out directory)"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(
            f"--calibrate {path}: not a JSON file ({exc}); give the profile.json of `fitlm profile`"
        ) from None
    timing = (data.get("plan") or {}).get("timing") if isinstance(data, dict) else None
    measured = data.get("step_time_s") if isinstance(data, dict) else None
    if not timing or not measured or not all(timing.get(k) for k in ("step_time_s", "efficiency", "tflops")):
        raise CalibrationError(
            f"--calibrate {path}: holds no measured step time and planned timing "
            "(`step_time_s`, `plan.timing`); re-run `fitlm profile` to get a complete profile.json"
        )
    rate = timing["tflops"] * timing["efficiency"] * timing["step_time_s"] / measured
    note = (
        f"calibrated from {path}: measured step {measured:.3g} s vs planned {timing['step_time_s']:.3g} s "
        f"({timing.get('device', '?')} at {timing['efficiency']:.0%} of {timing['tflops']:.3g} TFLOP/s), "
        f"so the device sustains {rate:.3g} TFLOP/s"
    )
    return rate, note


def calibrated_efficiency(rate_tflops: float, peak_tflops: float) -> float:
    """The efficiency at which a device of `peak_tflops` sustains `rate_tflops` (at most 1)."""
    return min(1.0, rate_tflops / peak_tflops)
