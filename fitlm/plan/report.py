"""Assemble a plan (both engines, search, diagnosis) into the blueprint's JSON and a rich table.

Why one dict for both outputs: the table is rendered from exactly what `--json` prints, so the two
can never disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from fitlm.config import Config, ConfigError
from fitlm.finetune.init_from import resolve_if_readable
from fitlm.parallel.layout import layout_problems
from fitlm.plan.activation_offload import note as offload_note
from fitlm.plan.analytic import ROLLOUT, Breakdown, breakdown
from fitlm.plan.devices import Device
from fitlm.plan.diagnose import dominant, remedies
from fitlm.plan.expert_parallel import experts_per_device
from fitlm.plan.finetune import (
    adapter_params,
    adapters,
    dequant_bytes,
    lora_targets,
    nf4_params,
    nf4_rank_bytes,
    reference_bytes,
    stage_trainable,
    trainable_params,
)
from fitlm.plan.grpo import summary as grpo_summary
from fitlm.plan.host import host_peaks, host_report, source_tensor
from fitlm.plan.max_seq import max_seq
from fitlm.plan.routing import ExpertLoad, describe
from fitlm.plan.routing import summary as routing_summary
from fitlm.plan.setup import Setup, from_config, on_device, routed_layers, to_overrides, total_params
from fitlm.plan.throughput import timing

GiB = 1024**3


def _layout(s: Setup) -> str:
    extra = [f"zero{s.zero}"] + (["sp"] if s.sp else []) + ([f"{s.schedule}×{s.chunks}"] if s.pp > 1 else [])
    return s.dims.name + " " + " ".join(extra)


def _memory_opts(s: Setup) -> str:
    opts = [s.level, f"recompute={s.recompute}"]
    if s.loss_chunk:
        opts.append(f"loss_chunk={s.loss_chunk}")
    if s.offload:
        opts.append("offload")
    if s.act_offload:
        opts.append(f"activation_offload={'blocks' if s.act_offload is True else s.act_offload}")
    if s.accum > 1 and s.dims.fsdp_sharded:
        opts.append("sync=every" if s.sync_every else "sync=last")  # parallel.gradient_sync
    return " ".join(opts) + f" mbs={s.mbs}×accum{s.accum}"


def _experts(s: Setup) -> dict[str, int]:
    """An MoE model's routed experts, all of them and those one device holds, and the share of each one's width it
    holds: 1/tp, `expert_width_split` = tp ({} for a dense model)."""
    e = s.cfg.model.num_experts
    if not e:
        return {}
    return {"experts": routed_layers(s) * e, "experts_per_device": experts_per_device(s), "expert_width_split": s.tp}


def _finetune(s: Setup) -> dict[str, Any]:
    out: dict[str, Any] = {
        "method": s.method,
        "trainable_params": trainable_params(s),
        "adapter_params": adapter_params(s),
        "objective": s.objective,
        # the most loaded rank's share (tensor-split; under pipeline parallel its stage's)
        "trainable_params_per_rank": int(max(stage_trainable(s, True), stage_trainable(s, False))),
    }
    if s.objective == "dpo":
        out["dpo"] = {
            "rows_per_micro_batch": s.rows,
            "reference": s.dpo_reference or "starting model",
            "reference_bytes": reference_bytes(s),
        }  # 0: LoRA's base with the adapters off
    elif s.objective == "grpo":  # the rollout phase (fitlm.plan.grpo)
        out["grpo"] = grpo_summary(s)
    elif s.pairs:  # SimPO: the pairs' rows, no reference model
        out[s.objective] = {"rows_per_micro_batch": s.rows, "reference_bytes": reference_bytes(s)}
    if adapters(s):
        out["lora"] = {"r": s.lora_r, "targets": list(lora_targets(s))}
    if s.method == "qlora":  # the 4-bit base: what it stores, and the one weight dequantized at a time
        out["qlora"] = {
            "nf4_params": nf4_params(s),
            "nf4_bytes_per_device": int(nf4_rank_bytes(s)),
            "dequant_bytes": int(dequant_bytes(s, s.rows * s.local_seq)),
        }
    elif s.method == "freeze":
        out["freeze"] = {"layers": s.freeze_layers, "embeddings": s.freeze_embeddings}
    return out


def plan(
    cfg: Config,
    dev: Device,
    num_devices: int | None = None,
    simulate: bool = False,
    search: bool = False,
    top: int = 5,
    best_out: str | None = None,
    longest: bool = False,
    expert_load: ExpertLoad | None = None,
) -> dict[str, Any]:
    """The plan's JSON; `longest` adds `max_seq` (fitlm plan --max-seq); an MoE model's `routing` holds the
    worst-case routing beside the balanced plan (fitlm.plan.routing; `expert_load`: plan --expert-load)."""
    # With model.init_from the weights define the network, as in training (the same resolver).
    cfg, note = resolve_if_readable(cfg)
    n = num_devices or cfg.parallel.world_size
    if not search:
        problems = layout_problems(cfg, n)
        if problems:
            raise ConfigError(problems)
    s = on_device(from_config(cfg), dev.name)
    mem = breakdown(s)
    t = timing(s, dev)
    fits_device = mem.total <= dev.usable_bytes
    source = source_tensor(s)
    host = host_peaks(s, mem, dev, source)
    fits = fits_device and host.fits  # a run the host cannot hold (at load, step or save) does not fit either
    out: dict[str, Any] = {
        "model": {"arch": s.arch, "params": total_params(s), "layers": s.layers, "hidden_size": s.h, **_experts(s)},
        "finetune": _finetune(s),
        "device": {
            "name": dev.name,
            "memory_bytes": dev.memory_bytes,
            "usable_bytes": dev.usable_bytes,
            "tflops": dev.tflops,
            "efficiency": dev.efficiency,
            "num_devices": n,
            "source": dev.source,
        },
        "layout": _layout(s),
        "memory_options": _memory_opts(s),
        "per_device": mem.as_dict(),
        "other_parts": dict(mem.other_parts),
        "param_parts": dict(mem.param_parts),
        "activation_parts": dict(mem.activation_parts),
        "peak_phase": mem.phase,
        "host_bytes_per_device": mem.host,
        "host_activation_bytes": mem.host_activations,
        "host": host_report(host, source, dev.host_source),
        "fits": fits,
        "fits_device": fits_device,
        "step_time_s": t.step_s,
        "tokens_per_s": t.tokens_per_s,
        "mfu": t.mfu,
        "flops_per_token": t.flops_per_token,
        "time_breakdown_s": {
            "compute": t.compute_s,
            "tensor_parallel_comm": t.tp_comm_s,
            "data_parallel_comm_exposed": t.dp_comm_s,
            "pipeline_comm": t.pp_comm_s,
            "pipeline_bubble": t.bubble_s,
            **dict(t.features),  # e.g. context_parallel_comm, activation_offload_copies, expert_parallel_all_to_all
        },
    }
    notes = [n for n in (note, offload_note(s)) if n]
    if notes:
        out["notes"] = notes
    if longest:
        out["max_seq"] = max_seq(s, dev, source).as_dict()
    if s.cfg.model.moe:
        out["routing"] = routing_summary(s, mem, expert_load)
    if not fits_device:
        out["diagnosis"] = _diagnosis(s, mem, dev)
    if simulate:
        _add_simulations(out, cfg, s, dev)
    if search:
        out["search"] = _search(cfg, n, dev, top, best_out)
    return out


def _diagnosis(s: Setup, mem: Breakdown, dev: Device) -> dict[str, Any]:
    """Why it does not fit: the dominant component, by how much, and the ranked remedies."""
    fixes = remedies(s)
    return {
        "dominant": dominant(mem),
        "over_by_bytes": mem.total - dev.usable_bytes,
        "remedies": [
            {
                "change": r.change,
                "saves_bytes": r.saved(mem),
                "total": r.memory.total,
                "fits": r.memory.total <= dev.usable_bytes,
            }
            for r in fixes[:6]
        ],
    }


def _add_simulations(out: dict[str, Any], cfg: Config, s: Setup, dev: Device) -> None:
    """--simulate: the step as planned (balanced routing) in `simulated`, and under expert parallel the same step
    with the simulated rank's experts the loaded ones in `routing.simulated_worst_case` (fitlm.plan.routing)."""
    out["simulated"] = _simulated(cfg, s, dev)
    worst = out.get("routing", {}).get("imbalance", 1)
    if worst > 1 and "per_device" in out["simulated"]:
        out["routing"]["simulated_worst_case"] = _simulated(cfg, s, dev, worst)["per_device"]


def _simulated(cfg: Config, s: Setup, dev: Device, imbalance: float = 1.0) -> dict[str, Any]:
    """--simulate: the real step on fake tensors, per component (or why it cannot run); `imbalance`: the routing's
    worst case (fitlm.plan.routing), the simulated rank's experts receiving that many times their balanced rows."""
    from fitlm.plan.simulate import SimulationUnsupported, run_step

    try:
        sim = run_step(cfg, imbalance=imbalance)
        note = "logits are counted inside activations by the simulation"
        if reference_bytes(s):  # fitlm.plan.simulate: the policy stood in for the reference's forward
            note += "; the DPO reference copy is added from the analytic count, under other"
        if s.offload_mode != "none":  # fake tensors on the CPU: nothing to offload to
            note += "; it runs on CPU tensors, where memory.activation_offload moves nothing"
        return {"per_device": sim, "fits": sim["total"] <= dev.usable_bytes, "note": note}
    except SimulationUnsupported as e:
        return {"error": str(e)}


def _search(cfg: Config, n: int, dev: Device, top: int, best_out: str | None) -> dict[str, Any]:
    """--search: the fastest fitting layouts for `n` devices (and the best one written as a config)."""
    from fitlm.plan.search import best_per_layout, candidates

    found = candidates(cfg, n, dev)
    best = best_per_layout(found, top)
    found_out: dict[str, Any] = {
        "num_devices": n,
        "fitting_candidates": len(found),
        "top": [
            {
                "layout": _layout(c.setup),
                "memory_options": _memory_opts(c.setup),
                "per_device_total": c.memory.total,
                "host_per_node": c.host.worst[1],
                "tokens_per_s": c.timing.tokens_per_s,
                "mfu": c.timing.mfu,
                "step_time_s": c.timing.step_s,
                "why": c.why(dev),
            }
            for c in best
        ],
    }
    if best and best_out:
        found_out["best_yaml"] = write_best(cfg, best[0].setup, best_out)
    return found_out


def write_best(cfg: Config, s: Setup, path: str) -> str:
    data = cfg.to_dict()
    for section, values in to_overrides(s).items():
        data[section].update(values)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _render_host(console, h: dict[str, Any]) -> None:
    r, node = h["per_rank"], h["per_node"]
    console.print(
        f"host per rank: load {gib(r['load'])}, step {gib(r['step'])}, save {gib(r['save'])} (rank 0); "
        f"per node ({h['ranks_per_node']} rank{'s' if h['ranks_per_node'] != 1 else ''}): "
        f"{gib(node[h['peak_moment']])} at {h['peak_moment']} of "
        f"{gib(h['usable_bytes'])} usable ({h['ram_source'] or 'host RAM'})"
    )
    if not h["fits"]:
        console.print(
            f"[red]warning: host memory[/red]: the {h['peak_moment']} needs {gib(node[h['peak_moment']])} "
            f"per node, {gib(h['over_by_bytes'])} over the host's usable RAM; give fewer ranks per node, "
            "a host with more RAM (--host-memory), or less offload"
        )


# fitlm.plan.analytic's peak phases, as the table's header explains them.
PEAK_MOMENTS = {
    "forward/backward": "forward/backward: the loss or the first recomputed block, before this micro batch's gradients",
    "optimizer step": "optimizer step: gradients complete, activations freed",
    ROLLOUT: "GRPO's rollout (sampling): weights, optimizer states, the KV cache and the sampling logits",
}


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    if "device_source" in result:  # which device, and why (fitlm.plan.device_choice)
        console.print(result["device_source"]["note"], markup=False)
    d = result["device"]
    f = result["finetune"]
    what = (
        ""
        if f["method"] == "full"
        else (
            f" ({f['method']}: {f['trainable_params'] / 1e6:.3g}M trainable, "
            f"{f['trainable_params'] / result['model']['params']:.2%})"
        )
    )
    m = result["model"]
    if "experts" in m:  # MoE: what a device holds of them (its pipeline stage's blocks, its ep share)
        what += f" · {m['experts_per_device']} of {m['experts']} experts per device"
        if m.get("expert_width_split", 1) > 1:  # tensor parallel splits each expert on its width
            what += f" (1/{m['expert_width_split']} of each)"
    console.print(
        f"[bold]{result['model']['arch']} {result['model']['params'] / 1e9:.3g}B params[/bold]{what} · "
        f"{result['layout']} · {result['memory_options']} · {d['num_devices']}× {d['name']}"
    )
    table = Table()
    # Each row is its component's bytes at that one moment, not its own maximum: a full fine-tuning plan whose peak
    # is in forward/backward shows grads 0 (this step's gradients do not exist yet), which read as a bug unsaid.
    table.add_column("per device, at the peak moment")
    table.add_column("analytic", justify="right")
    sim = result.get("simulated", {}).get("per_device")
    if sim:
        table.add_column("simulated", justify="right")
    routing = result.get("routing", {})
    worst = routing["worst_case"] if routing.get("imbalance", 1) > 1 else None  # MoE under expert parallel
    columns = [c for c in (sim, worst, routing.get("simulated_worst_case")) if c]  # beside the analytic one
    if worst:
        table.add_column("worst-case routing", justify="right")
    if routing.get("simulated_worst_case"):
        table.add_column("worst case, simulated", justify="right")
    for key, value in result["per_device"].items():
        table.add_row(key, gib(value), *[gib(c[key]) for c in columns], style="bold" if key == "total" else None)
        named = {"params": "param_parts", "other": "other_parts", "activations": "activation_parts"}.get(key)
        if named:  # the named parts of `params`, `other` and `activations` (the simulation cannot tell them apart)
            for part, nbytes in result.get(named, {}).items():
                table.add_row(f"  {part}", gib(nbytes), *[""] * len(columns), style="dim")
    console.print(table)
    verdict = "[green]fits[/green]" if result["fits_device"] else "[red]does not fit[/red]"
    console.print(
        f"{verdict}: {gib(result['per_device']['total'])} of {gib(d['usable_bytes'])} usable "
        f"({gib(d['memory_bytes'])} minus runtime reserve); each row is at the peak moment, "
        f"{PEAK_MOMENTS.get(result['peak_phase'], result['peak_phase'])}"
        + (f"; {gib(result['host_bytes_per_device'])} in host memory" if result["host_bytes_per_device"] else "")
    )
    if routing:
        console.print(describe(routing, d["usable_bytes"]), markup=False)
    _render_host(console, result["host"])
    for note in result.get("notes", []):
        console.print(f"note: {note}")
    if "error" in result.get("simulated", {}):
        console.print(f"simulation: {result['simulated']['error']}")
    longest = result.get("max_seq")
    if longest:
        console.print(
            f"longest data.seq_length that fits: [bold]{longest['length']}[/bold] (multiples of "
            f"{longest['multiple_of']}, limited by {longest['limited_by']}); {longest['note']}"
        )
    console.print(
        f"step {result['step_time_s']:.3g} s · {result['tokens_per_s']:,.0f} tokens/s · MFU "
        f"{result['mfu']:.1%} (device efficiency {d['efficiency']:.0%} of {d['tflops']:g} TFLOP/s)"
    )
    diag = result.get("diagnosis")
    if diag:
        console.print(f"[bold]{diag['dominant']}[/bold] dominates; over by {gib(diag['over_by_bytes'])}. Remedies:")
        for r in diag["remedies"]:
            mark = "fits" if r["fits"] else "still over"
            console.print(f"  {r['change']}: saves {gib(r['saves_bytes'])} -> {gib(r['total'])} ({mark})")
    found = result.get("search")
    if found:
        _render_search(console, found)


def _render_search(console, found: dict[str, Any]) -> None:
    from rich.table import Table

    st = Table(
        title=f"fastest fitting layouts on {found['num_devices']} devices "
        f"({found['fitting_candidates']} candidates fit)"
    )
    for col in ("#", "layout", "memory", "per device", "tokens/s", "MFU", "why"):
        st.add_column(col)
    for i, c in enumerate(found["top"], 1):
        st.add_row(
            str(i),
            c["layout"],
            c["memory_options"],
            gib(c["per_device_total"]),
            f"{c['tokens_per_s']:,.0f}",
            f"{c['mfu']:.1%}",
            c["why"],
        )
    console.print(st)
    if not found["top"]:
        console.print("[red]no layout fits[/red]: add devices, or a device with more memory")
    if found.get("best_yaml"):
        console.print(f"best layout written to {found['best_yaml']}")
