"""`fitlm profile`: argument parsing, the output directory, launching; the work is in fitlm.profile.

With a layout of several processes the command re-runs itself under torchrun (as `fitlm train` does);
every rank trains and measures, rank 0 gathers, plans the same config and writes the report.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from fitlm.cli_common import add_config_args, process_count

MARKERS = ("profile.json", "report.md", "burst")  # what says a directory holds an earlier profile


class ProfileError(ValueError):
    """A bad `fitlm profile` argument or output directory."""


def add_commands(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="a short measured training burst: speed, memory by category, held against the plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train --steps real steps under the config's layout (into a scratch directory; "
        "train.output_dir is never touched) and measure per rank: tokens/s, MFU, step time by "
        "phase and communication, peak live tensor bytes by category and by module. Holds the "
        "result against `fitlm plan` (analytic and simulated) and writes report.md, PNG plots "
        "and profile.json into --out.",
        epilog="examples:\n"
        "  fitlm profile configs/tiny.yaml --steps 20 --out runs/tiny-profile\n"
        "  fitlm profile configs/tiny.yaml --nproc 2 --set parallel.data_parallel=2 --json",
    )
    add_config_args(p)
    p.add_argument(
        "--steps",
        type=int,
        default=50,
        metavar="N",
        help="timed training steps (default 50; at least 2: the first is warm-up); four more are traced "
        "and memory-tracked",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where report.md, the plots and profile.json go (default: train.output_dir + '-profile')",
    )
    p.add_argument("--force", action="store_true", help="replace an earlier profile in --out")
    p.add_argument(
        "--nproc",
        type=process_count,
        default=None,
        metavar="N",
        help="processes to launch on this node (default: the layout's data×tensor×pipeline product)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_profile)


def default_out(train_output_dir: str) -> Path:
    out = Path(train_output_dir)
    return out.with_name(out.name + "-profile")


def check_out(out: Path, force: bool, clear: bool) -> None:
    """Refuse a non-empty --out unless it holds an earlier profile and --force is given; `clear` deletes it then."""
    if out.exists() and not out.is_dir():
        raise ProfileError(f"--out: {out} is a file; point it at a directory")
    if not (out.is_dir() and any(out.iterdir())):
        return
    if not force:
        raise ProfileError(
            f"--out: {out} is not empty; choose a new or empty directory, or pass --force to replace "
            "the earlier profile there"
        )
    if not any((out / m).exists() for m in MARKERS):
        raise ProfileError(
            f"--out: {out} is not empty and holds no fitlm profile (no profile.json or report.md); "
            "--force replaces only an earlier profile, so choose a new or empty directory"
        )
    if clear:
        shutil.rmtree(out)


def cmd_profile(args: argparse.Namespace) -> int:
    from fitlm.cli_common import emit_json
    from fitlm.parallel.launch import launch_local
    from fitlm.parallel.mesh import env_world_size, launched_by_torchrun
    from fitlm.profile.burst import burst_config, run_burst
    from fitlm.run_config import load_run_config

    if args.steps < 2:
        raise ProfileError(
            f"--steps {args.steps}: at least 2 steps are needed (the first is warm-up, left out of "
            "the averages); the default is 50"
        )
    if not Path(args.config).is_file():
        raise ProfileError(f"CONFIG: {args.config} does not exist; pass a fitlm YAML config (e.g. configs/tiny.yaml)")
    # Resolved once, here, from the user's own YAML and --set (the only place that knows which model keys
    # the user set): the burst, the dry run before a relaunch and the report all see the real network.
    cfg, _ = load_run_config(args.config, args.overrides)
    out = Path(args.out) if args.out else default_out(cfg.train.output_dir)
    joined = launched_by_torchrun()
    rank = int(os.environ.get("RANK", "0"))
    world = env_world_size() if joined else (args.nproc or cfg.parallel.world_size)
    if not (joined and args.force and rank != 0):  # with --force only rank 0 clears (nothing is written before
        check_out(out, args.force, clear=rank == 0)  # the trainer's first barrier, so the ranks agree)
    if world > 1 and not joined:
        from fitlm.train.dry_run import dry_run

        dry_run(burst_config(cfg, out, args.steps), world)  # every problem once, before any process starts
        return launch_local(world, list(args.argv))
    ranks = run_burst(cfg, args.steps, out)
    if ranks is None:
        return 0  # not rank 0: it measured, rank 0 reports
    result = report(cfg, args.config, args.steps, ranks, out)
    if args.json:
        emit_json(result)
    else:
        _print_summary(result, out)
    return 0


def report(cfg, config_path: str, steps: int, ranks: list[dict], out: Path) -> dict:
    """Plan the same config, hold the measurement against it, write profile.json, report.md and the plots."""
    from fitlm.profile.compare import plan_for
    from fitlm.profile.plots import write_plots
    from fitlm.profile.report import assemble, write_json, write_markdown

    print("fitlm profile: planning the same config (analytic, simulated)", file=sys.stderr, flush=True)
    plan = plan_for(cfg, ranks[0]["device"], ranks[0]["peak_flops"])
    result = assemble(cfg, config_path, steps, ranks, plan)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(result, out)
    result["files"] = {
        "report": str(out / "report.md"),
        "json": str(out / "profile.json"),
        "plots": [str(out / p) for p in plots],
    }
    write_json(result, out)
    write_markdown(result, out, plots)
    return result


def _print_summary(r: dict, out: Path) -> None:
    MiB = 2**20
    err = r["errors"].get("analytic", {}).get("total")
    sim = r["errors"].get("simulated", {}).get("total")
    lines = [
        f"{r['layout']} · {r['world_size']} process(es) · {r['steps']} steps",
        f"{r['tokens_per_s']:,.0f} tokens/s · MFU {r['mfu']:.2%} · step {r['step_time_s']:.4f} s · "
        f"communication {r['comm_share']:.1%}",
        f"peak {r['peak_bytes'] / MiB:,.2f} MiB ({r['peak_kind']}) · RSS {r['rss_peak_bytes'] / MiB:,.1f} MiB",
    ]
    if err is not None:
        lines.append(
            f"plan error vs measured total: analytic {err:+.1%}"
            + (f", simulated {sim:+.1%}" if sim is not None else "")
        )
    lines.append(f"report: {out / 'report.md'}")
    sys.stderr.write("\n".join(lines) + "\n")
