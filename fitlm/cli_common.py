"""What every command module shares: CONFIG and --set, the --nproc type, JSON and table output (progress on
stderr: fitlm.progress).

The command modules (`fitlm/<package>/cli.py`) import this, never `fitlm.cli`, which sits on top of
them all and only dispatches.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def process_count(text: str) -> int:
    """--nproc: a whole number of processes, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; pass the processes to start, e.g. 2"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{n}: at least 1 process is needed; pass e.g. 2, or leave --nproc out "
            "to start the layout's data×tensor×pipeline product"
        )
    return n


def add_config_args(p: argparse.ArgumentParser) -> None:
    """CONFIG and repeatable --set KEY=VALUE: every command that reads a fitlm config takes them alike."""
    p.add_argument("config", metavar="CONFIG", help="YAML config file (see `fitlm config docs` for every key)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=1e-4 (repeatable)",
    )


def emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")


def print_table(title: str, rows: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for k, v in rows.items():
        table.add_row(str(k), f"{v:.4f}" if isinstance(v, float) else str(v))
    Console(stderr=True).print(table)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def say(text: str) -> None:
    """One line on stderr, safe inside a signal handler (the launcher's and the trainer's stop messages)."""
    try:
        os.write(2, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass  # stderr closed: the exit status still tells
