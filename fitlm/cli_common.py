"""What every command module shares: CONFIG and --set, the --nproc type, JSON and table output.

The command modules (`fitlm/<package>/cli.py`) import this, never `fitlm.cli`, which sits on top of
them all and only dispatches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

_T = TypeVar("_T")
# Set by a caller that reads stderr (fitlm ui's export jobs): progress as plain "<what>: i/n" lines
PROGRESS_LINES = "FITLM_PROGRESS_LINES"


def counted(items: Iterable[_T], total: int, what: str) -> Iterator[_T]:
    """`items`, reporting how many have passed on stderr: a progress bar on a terminal, "<what>: i/n" lines where
    FITLM_PROGRESS_LINES is set (a page that shows the log), nothing otherwise (logs stay as they were)."""
    if os.environ.get(PROGRESS_LINES):
        for i, item in enumerate(items, 1):
            yield item
            print(f"{what}: {i}/{total}", file=sys.stderr, flush=True)
        return
    if not sys.stderr.isatty():
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(what, total=total)
        for item in items:
            yield item
            bar.advance(task)


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
