"""`fitlm` command line: parses arguments and dispatches to the library; no logic of its own.

Errors that a user can fix (bad config, data or paths) print one paragraph naming the key or file
and the fix, and exit with status 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback

from fitlm.checkpoint.errors import TrainingInterrupted
from fitlm.cli_common import add_config_args, emit_json, print_table, process_count

EXIT_USER_ERROR = 2
# Modules with `add_commands(subparsers)`: one per command group, owned by the package it drives.
COMMAND_MODULES = (
    "fitlm.data.cli",
    "fitlm.checkpoint.cli",
    "fitlm.finetune.cli",
    "fitlm.plan.cli",
    "fitlm.export.cli",
    "fitlm.profile.cli",
    "fitlm.serve.cli",
    "fitlm.ui.cli",
    "fitlm.eval.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fitlm",
        description="Pretrain and fine-tune LLMs on the hardware you have.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with `make demo`, or: fitlm data tokenizer ... ; fitlm data pack ... ; fitlm train CONFIG",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_train(sub)
    _add_generate(sub)

    for module in COMMAND_MODULES:  # command groups that live beside the code they drive
        importlib.import_module(module).add_commands(sub)

    p = sub.add_parser("config", help="config helpers: show a resolved config, print the reference, import one")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    q = csub.add_parser("show", help="validate a config and print it with every default filled in")
    add_config_args(q)
    q.set_defaults(func=cmd_config_show)
    q = csub.add_parser("docs", help="print the config reference (markdown) from the schema")
    q.set_defaults(func=cmd_config_docs)
    importlib.import_module("fitlm.plan.cli").add_config_commands(csub)  # config import (MindFormers YAML)
    return parser


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a YAML config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train (pretrain or fine-tune) from one YAML config. Writes config.yaml, "
        "metrics.jsonl and, at the end, the model/ directory under train.output_dir.\n"
        "Every problem with the config, data or tokenizer is reported before anything is written.",
        epilog="examples:\n"
        "  fitlm train configs/tiny.yaml --dry-run\n"
        "  fitlm train configs/tiny.yaml --set train.lr=1e-3 --set train.max_steps=100\n"
        "  fitlm config docs    # every config key, its default and meaning",
    )
    add_config_args(p)
    p.add_argument(
        "--nproc",
        type=process_count,
        default=None,
        metavar="N",
        help="processes to launch on this node (default: the layout's data×tensor×pipeline product)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, data and tokenizer, print the run's shape, and exit without training",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete a previous run in train.output_dir instead of refusing to touch it",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart all processes up to N times when one dies (torchrun --max-restarts); each restart "
        "resumes from the latest checkpoint (set checkpoint.interval)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout at the end")
    p.set_defaults(func=cmd_train)


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a trained or imported model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Continue --prompt with a KV cache, streaming the text; stops at EOS or after "
        "--max-new-tokens.\nMODEL is a fitlm model directory, a training output "
        "directory (its model/ is used), or a Hugging Face directory.",
        epilog="examples:\n"
        "  fitlm generate demo/run --prompt 'KING LEAR.'                      # greedy\n"
        "  fitlm generate demo/run --prompt 'KING LEAR.' --temperature 0.8 --top-p 0.9\n"
        "  fitlm generate demo/run --prompt 'KING LEAR.' --json               # for scripts",
    )
    p.add_argument("model", metavar="MODEL", help="fitlm model dir, training output dir, or Hugging Face dir")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue (a BOS token is put before it)")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 = greedy decoding (default); above 0 samples, higher is more random",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample only from the smallest token set whose probability reaches P (default 1.0 = all)",
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="sampling seed, for reproducible samples (default 0)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {"prompt", "text", "token_ids"} on stdout instead of streaming',
    )
    p.set_defaults(func=cmd_generate)


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from fitlm.parallel.launch import launch_local, restart_count
    from fitlm.parallel.mesh import env_world_size, launched_by_torchrun
    from fitlm.run_config import load_run_config
    from fitlm.train.dry_run import dry_run
    from fitlm.train.run_lock import HELD_BY, acquire_run_lock
    from fitlm.train.trainer import Trainer

    cfg, _ = load_run_config(args.config, args.overrides)  # resolved (model.init_from read) and checked once
    joined = launched_by_torchrun()
    world = env_world_size() if joined else (args.nproc or cfg.parallel.world_size)
    if args.dry_run or ((world > 1 or args.max_restarts > 0) and not joined):
        # Every check a run makes, once, here: workers would otherwise each print the same error.
        summary = dry_run(cfg, world, overwrite=args.overwrite)
        if args.dry_run:
            emit_json(summary) if args.json else print_table("dry run: everything checks out", summary)
            return 0
        # The launcher holds the run lock for the ranks it starts (they see HELD_BY and take none).
        with acquire_run_lock(cfg.train.output_dir, "fitlm " + " ".join(argv)) as lock:
            rc = launch_local(world, argv, args.max_restarts, extra_env={HELD_BY: str(os.getpid())})
            lock.release({0: "finished", 143: "stopped"}.get(rc, "failed"))  # what `fitlm ui` lists
            return rc
    # A restarted attempt continues the run it belongs to: --overwrite applied to the first attempt only.
    result = Trainer(cfg, overwrite=args.overwrite and restart_count() == 0).fit()
    if not result.is_main:
        return 0
    summary = {
        "output_dir": str(result.output_dir),
        "model_dir": str(result.model_dir),
        "steps": result.steps,
        "first_loss": result.first_loss,
        "last_loss": result.last_loss,
        "eval_loss": result.eval_loss,
    }
    if args.json:
        emit_json(summary)
    else:
        print_table("training finished", summary)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from fitlm.infer.generate import check_sampling
    from fitlm.infer.text import generate_text

    check_sampling(args.temperature, args.top_p)  # before anything is printed

    def write_piece(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    stream = None if args.json else write_piece
    out = generate_text(
        args.model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stream=stream,
        # the prompt is echoed once the model and tokenizer loaded: a bad MODEL prints only its error
        ready=(lambda: write_piece(args.prompt)) if stream else None,
    )
    if args.json:
        emit_json(out)
    else:
        sys.stdout.write("\n")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from fitlm.run_config import load_run_config

    # Printed resolved: the full dump spells out every model key, so an unresolved one, used as a config,
    # would contradict the model.init_from weights in each default.
    cfg, note = load_run_config(args.config, args.overrides, weights_optional=True)
    if note:
        sys.stderr.write(f"fitlm config show: note: {note}\n")
    sys.stdout.write(cfg.to_yaml())
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    from fitlm.config import config_reference_markdown

    sys.stdout.write(config_reference_markdown())
    return 0


def _is_user_error(exc: BaseException) -> bool:
    # fitlm's own error classes (ConfigError, DataError, ...) describe a fixable input problem.
    return isinstance(exc, ValueError) and type(exc).__module__.startswith("fitlm")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # commands that re-run themselves under torchrun (profile) pass it on
    from fitlm.parallel.lifetime import die_with_parent
    from fitlm.parallel.mesh import exit_process, launched_by_torchrun

    if not launched_by_torchrun():
        return _dispatch(args, argv)
    die_with_parent(signal.SIGKILL)  # a rank never outlives its torchrun agent (fitlm.parallel.lifetime)
    # A rank under torchrun leaves through exit_process: a normal interpreter exit can abort a finished
    # gloo rank (see exit_process), and torchrun would then report the whole run as failed.
    try:
        code = _dispatch(args, argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: keep its traceback, then leave like any other rank
        traceback.print_exc()
        code = 1
    exit_process(code)


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the chosen command; user errors become one paragraph and status 2, bugs keep their traceback."""
    try:
        return args.func(args, argv) if args.func is cmd_train else args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except TrainingInterrupted as exc:  # SIGTERM: a checkpoint was saved; exit as a terminated process would
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"fitlm {args.command}: {exc}\n")
        return 143
    except Exception as exc:  # noqa: BLE001 - user errors get a paragraph, bugs keep their traceback
        if not _is_user_error(exc):
            raise
        rank = os.environ.get("RANK", "0")
        prefix = "" if rank == "0" else f"[rank {rank}] "
        sys.stderr.write(f"{prefix}fitlm {args.command}: error: {exc}\n")
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
