"""The profile's PNG charts (matplotlib, Agg backend: no display needed): memory measured vs planned,
step-time breakdown per rank, loss and throughput over the burst."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitlm.profile.compare import COMPONENTS, comparable

MiB = 2**20


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return True


def memory_plot(r: dict[str, Any], path: Path) -> bool:
    if r["per_device"] is None:
        return False
    plt = _pyplot()
    series = {"measured": r["per_device"], "analytic": comparable(r["plan"]["analytic"]["per_device"])}
    sim = r["plan"].get("simulated", {}).get("per_device")
    if sim:
        series["simulated"] = comparable(sim)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(COMPONENTS))]
        ax.bar(xs, [values[k] / MiB for k in COMPONENTS], width, label=name)
    ax.set_xticks(range(len(COMPONENTS)), COMPONENTS)
    ax.set_ylabel("MiB per device")
    ax.set_title(f"memory: measured (rank {r['most_loaded_rank']}) vs planned · {r['layout']}")
    ax.legend()
    return _save(plt, fig, path)


def step_time_plot(r: dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    ranks = r["per_rank"]
    phases = sorted({k for x in ranks for k in x["phase_s"]}, key=lambda k: (k == "other", k))
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.5 * len(ranks)))
    left = [0.0] * len(ranks)
    for phase in phases:
        widths = [x["phase_s"].get(phase, 0.0) for x in ranks]
        ax.barh([f"rank {x['rank']}" for x in ranks], widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    comm = [x["comm"]["comm_s"] for x in ranks]
    if any(comm):
        ax.scatter(
            comm,
            [f"rank {x['rank']}" for x in ranks],
            marker="|",
            s=400,
            color="black",
            label="communication (overlaps)",
        )
    ax.set_xlabel("seconds per step")
    ax.set_title("step-time breakdown")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside: never over the axis label
    return _save(plt, fig, path)


def burst_plot(r: dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    hist = r["history"]
    steps = [h["step"] for h in hist]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.plot(steps, [h["loss"] for h in hist], marker="o", markersize=3)
    top.set_ylabel("loss")
    top.set_title("the burst (rank 0); step 1 is warm-up")
    bottom.plot(steps, [h["tokens_per_s"] for h in hist], marker="o", markersize=3, color="tab:green")
    bottom.axhline(
        r["tokens_per_s"], linestyle="--", color="gray", label="tokens per step / mean step time (after warm-up)"
    )
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("step")
    bottom.legend()
    return _save(plt, fig, path)


PLOTS = {"memory.png": memory_plot, "step_time.png": step_time_plot, "burst.png": burst_plot}


def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    """Write every chart that has data; returns their file names (relative to `out`)."""
    return [name for name, draw in PLOTS.items() if draw(result, out / name)]
