"""`fitlm plan`, `fitlm budget` and `fitlm config import`: argument parsing and printing only; the work is in
fitlm.plan."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from fitlm.cli_common import add_config_args

if TYPE_CHECKING:
    from fitlm.plan.devices import Device


def add_commands(sub) -> None:
    _add_plan(sub)
    _add_budget(sub)


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="memory per device, fit, speed and the fastest layout, before any run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Account per-device memory (params, grads, optimizer, activations, logits, other) "
        "for the config's layout, say whether it fits, and estimate step time, tokens/s "
        "and MFU. --simulate also runs the real training step on fake tensors.",
        epilog="examples:\n"
        "  fitlm plan configs/tiny.yaml --device cpu --simulate\n"
        "  fitlm plan configs/llama2-7b.yaml --device a100-80g --num-devices 8 --search\n"
        "  fitlm plan CONFIG --device-memory 48GiB --device-tflops 181 --json",
    )
    add_config_args(p)
    p.add_argument(
        "--device",
        default=None,
        metavar="NAME",
        help="a100-40g, a100-80g, h100-80g, h200, rtx4090, rtx3090, ascend-910b, cpu (measured); default: "
        "cpu if the config says train.device: cpu, else this machine's GPU, else a100-80g (the report's first "
        "line says which and why)",
    )
    p.add_argument("--device-memory", default=None, metavar="SIZE", help="device memory, e.g. 80GiB or 40GB")
    p.add_argument("--device-tflops", type=float, default=None, metavar="T", help="dense half-precision peak TFLOP/s")
    p.add_argument(
        "--device-bandwidth",
        type=float,
        default=None,
        metavar="GB/S",
        help="intra-node link bandwidth per device, one direction, GB/s",
    )
    p.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="RAM of one node's host, e.g. 512GB (default: the catalog's node, or this machine's)",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        metavar="F",
        help="achieved fraction of peak (e.g. the MFU `fitlm profile` measured); default per device",
    )
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="PROFILE",
        help="set the efficiency from a `fitlm profile` result (profile.json or its directory) measured "
        "on this device, so the plan reproduces the measured step time",
    )
    p.add_argument(
        "--expert-load",
        default=None,
        metavar="PROFILE|F",
        help="an MoE model's routing skew for the worst-case plan under expert parallel: max / mean tokens per "
        "expert, as a number or measured (a `fitlm profile` profile.json, a run's metrics.jsonl, or their "
        "directory); default: model.capacity_factor's bound, else every token's experts on one rank",
    )
    p.add_argument(
        "--num-devices", type=int, default=None, metavar="N", help="devices (default: the layout's dp×tp×pp)"
    )
    p.add_argument("--search", action="store_true", help="rank every fitting layout × memory option for N devices")
    p.add_argument("--top", type=int, default=5, metavar="K", help="candidates to show with --search (default 5)")
    p.add_argument(
        "--best-out", default=None, metavar="FILE", help="with --search: write the best layout as a config YAML"
    )
    p.add_argument(
        "--max-seq",
        action="store_true",
        help="also find the longest data.seq_length (a multiple of 2 × context_parallel, at most "
        "model.max_seq_len) that fits the layout on the device (JSON key max_seq)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="also run the real training step on fake tensors and report its peak per component",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_plan)


def _add_budget(sub) -> None:
    p = sub.add_parser(
        "budget",
        help="compute-optimal model size and tokens for a FLOP or hardware budget",
        description="Chinchilla (Hoffmann et al. 2022): Approach 1 by default (~20 tokens per "
        "parameter); --rule parametric or replication (Besiroglu et al. 2024).",
    )
    p.add_argument("--flops", type=float, default=None, metavar="C", help="training FLOPs, e.g. 1e23")
    p.add_argument("--device", default=None, metavar="NAME", help="catalog device (with --num-devices and --hours)")
    p.add_argument("--num-devices", type=int, default=None, metavar="N")
    p.add_argument("--hours", type=float, default=None, metavar="H")
    p.add_argument("--mfu", type=float, default=0.4, metavar="F", help="expected MFU (default 0.4)")
    p.add_argument("--rule", default="approach1", choices=["approach1", "parametric", "replication"])
    p.add_argument(
        "--params",
        type=float,
        default=None,
        metavar="N",
        help="also: hours to train a model of N parameters on --tokens (default 20·N) with the hardware",
    )
    p.add_argument("--tokens", type=float, default=None, metavar="D")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_budget)


def add_config_commands(csub) -> None:
    """`fitlm config import`, under the `config` group that fitlm.cli owns."""
    q = csub.add_parser(
        "import",
        help="translate a MindSpore Transformers (MindFormers) YAML into a fitlm config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Translate a MindFormers training YAML (model.model_config, parallel_config, "
        "recompute_config, runner_config, optimizer, lr_schedule, ...) into a fitlm "
        "config. Every source key that has no fitlm equivalent, or was approximated, "
        "gets a note naming it (stderr, and comments at the top of the written file).",
        epilog="examples:\n"
        "  fitlm config import examples/mindformers/llama2_7b.yaml --out llama2_7b.yaml\n"
        "  fitlm plan llama2_7b.yaml --device ascend-910b --search",
    )
    q.add_argument("source", metavar="FILE.yaml", help="MindSpore Transformers YAML")
    q.add_argument("--out", required=True, metavar="CONFIG", help="fitlm config file to write")
    q.add_argument("--force", action="store_true", help="replace --out if it exists")
    q.add_argument("--json", action="store_true", help='print {"out", "config", "notes": [{"key", "note"}]} on stdout')
    q.set_defaults(func=cmd_config_import)


def cmd_config_import(args: argparse.Namespace) -> int:
    from fitlm.plan.config_import import import_file

    cfg, notes = import_file(args.source, args.out, force=args.force)
    if args.json:
        sys.stdout.write(json.dumps({"out": args.out, "config": cfg.to_dict(), "notes": notes}) + "\n")
        return 0
    for n in notes:
        sys.stderr.write(f"note: {n['key']}: {n['note']}\n")
    m = cfg.model
    sys.stderr.write(
        f"wrote {args.out}: {m.arch} h{m.hidden_size} L{m.num_layers}, layout dp{cfg.parallel.data_parallel}"
        f"×tp{cfg.parallel.tensor_parallel}×pp{cfg.parallel.pipeline_parallel}, "
        f"{cfg.memory.mixed_precision} {cfg.memory.half_dtype}; {len(notes)} note(s) above. "
        f"Next: fitlm plan {args.out} --search\n"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from fitlm.plan.device_choice import choose_device
    from fitlm.plan.report import plan, render
    from fitlm.plan.routing import read_expert_load
    from fitlm.run_config import load_run_config

    # Resolved here (the model section from model.init_from, when readable) and checked once; plan() says why
    # when the weights are not on this machine.
    cfg, _ = load_run_config(args.config, args.overrides, weights_optional=True, layout=not args.search)
    calibration = None
    if args.calibrate is not None:
        from fitlm.plan.calibrate import CalibrationError, calibrated_efficiency, sustained_tflops

        if args.efficiency is not None:
            raise CalibrationError("--calibrate and --efficiency both set the device efficiency; give one of them")
        rate, calibration = sustained_tflops(args.calibrate)
    dev, device_source = choose_device(
        args.device,
        args.device_memory,
        args.device_tflops,
        args.device_bandwidth,
        args.efficiency,
        args.host_memory,
        config_device=cfg.train.device,
    )
    if calibration:
        dev = replace(dev, efficiency=calibrated_efficiency(rate, dev.tflops))
        calibration += f": efficiency {dev.efficiency:.1%} of {dev.name}'s {dev.tflops:.3g} TFLOP/s"
        sys.stderr.write(f"fitlm plan: {calibration}\n")
    result = plan(
        cfg,
        dev,
        args.num_devices,
        simulate=args.simulate,
        search=args.search,
        top=args.top,
        best_out=args.best_out,
        longest=args.max_seq,
        expert_load=read_expert_load(args.expert_load) if args.expert_load is not None else None,
    )
    if calibration:
        result["device"]["calibration"] = calibration
    result = {"device_source": device_source, **result}  # first: every figure below is for this device
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        render(result)
    return 0


class BudgetError(ValueError):
    """Missing or contradictory budget flags."""


def cmd_budget(args: argparse.Namespace) -> int:
    from fitlm.plan.budget import compute_optimal, hardware_flops, training_hours
    from fitlm.plan.devices import get_device

    hardware = args.device is not None
    if hardware and (args.num_devices is None or (args.hours is None and args.params is None)):
        raise BudgetError("--device needs --num-devices and --hours (or --params to get the hours)")
    if args.flops is None and not (hardware and args.hours is not None):
        raise BudgetError("give --flops C, or --device NAME --num-devices N --hours H")
    dev = get_device(args.device) if hardware else None
    flops = (  # (no --flops: then --device was given, checked above)
        args.flops
        if args.flops is not None
        else hardware_flops(cast("Device", dev).tflops, args.num_devices, args.hours, args.mfu)
    )
    b = compute_optimal(flops, args.rule)
    out = {
        "flops": b.flops,
        "params": b.params,
        "tokens": b.tokens,
        "rule": b.rule,
        "tokens_per_param": b.tokens / b.params,
    }
    if b.loss is not None:
        out["loss"] = b.loss
    if hardware:
        assert dev is not None  # (hardware: --device given)
        out["hours"] = training_hours(b.params, b.tokens, dev.tflops, args.num_devices, args.mfu)
        out["device"] = {"name": dev.name, "num_devices": args.num_devices, "mfu": args.mfu}
        if args.params:
            tokens = args.tokens or 20.0 * args.params
            out["given_model"] = {
                "params": args.params,
                "tokens": tokens,
                "hours": training_hours(args.params, tokens, dev.tflops, args.num_devices, args.mfu),
            }
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        for k, v in out.items():
            sys.stderr.write(f"{k:>17}: {v:.4g}\n" if isinstance(v, float) else f"{k:>17}: {v}\n")
    return 0
