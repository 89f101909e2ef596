"""`fitlm ckpt ...`: checkpoint commands (argument parsing only; the work is in fitlm.checkpoint)."""

from __future__ import annotations

import argparse

from fitlm.cli_common import emit_json, print_table


def add_commands(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect a training checkpoint, or merge it into one set of weights")
    csub = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")

    q = csub.add_parser(
        "inspect",
        help="step, layout, config and sizes of a checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="DIR is a checkpoints/step_N directory, or a run directory (its latest "
        "checkpoint). Every file's size is checked against the metadata.",
        epilog="example:\n  fitlm ckpt inspect runs/tour --json",
    )
    q.add_argument("dir", metavar="DIR", help="checkpoint directory or training output directory")
    q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    q.set_defaults(func=cmd_inspect)

    q = csub.add_parser(
        "merge",
        help="consolidate a sharded checkpoint into safetensors, an HF or a fitlm model dir",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reads the shards one transformer block at a time (any layout it was saved "
        "with) and writes Hugging Face-named weights, never holding the whole model.",
        epilog="examples:\n"
        "  fitlm ckpt merge runs/tour --out merged.safetensors\n"
        "  fitlm ckpt merge runs/tour/checkpoints/step_00000100 --out hf_dir --format hf\n"
        "  fitlm ckpt merge runs/tour --out model_dir --format fitlm   # usable as MODEL",
    )
    q.add_argument("dir", metavar="DIR", help="checkpoint directory or training output directory")
    q.add_argument(
        "--out", required=True, metavar="PATH", help="output file (safetensors) or new directory (hf, fitlm)"
    )
    q.add_argument(
        "--format",
        choices=["safetensors", "hf", "fitlm"],
        default="safetensors",
        help="safetensors: one file (default); hf: config.json + model.safetensors + tokenizer; "
        "fitlm: a fitlm model directory for generate/export/init_from",
    )
    q.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    q.set_defaults(func=cmd_merge)


def cmd_inspect(args: argparse.Namespace) -> int:
    from fitlm.checkpoint.inspect import inspect_checkpoint

    info = inspect_checkpoint(args.dir)
    if args.json:
        emit_json(info)
    else:
        rows = {k: v for k, v in info.items() if k not in ("config", "files", "contents")}
        rows["layout"] = info["layout"]["name"]
        rows.update(
            {f"{k} tensors": f"{v['tensors']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in info["contents"].items()}
        )
        print_table(f"checkpoint {info['path']}", rows)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from fitlm.checkpoint.merge import merge_checkpoint

    summary = merge_checkpoint(args.dir, args.out, args.format)
    emit_json(summary) if args.json else print_table("checkpoint merged", summary)
    return 0
