"""How a command shows its progress on stderr: a rich bar on a terminal, plain flushed lines anywhere else.

Why lines: a rich bar on a stream that is not a terminal draws nothing until its last frame, so a run watched
through a log file (`> run.log 2>&1`, nohup, CI, a cluster's job log, `fitlm ui`'s job page) showed nothing
for its whole length. A line is printed and flushed as it happens, so `tail -f` sees it.

Every command decides with `as_lines` and writes its lines through `Lines` (or `say`), so elapsed time and
ETA read the same everywhere: "<what>: <done>/<total>[, details], elapsed 1:02, ETA 13:58".
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TypeVar

_T = TypeVar("_T")

# Set (to anything but empty): lines even on a terminal. `fitlm ui` sets it for the jobs whose log it shows.
PROGRESS_LINES = "FITLM_PROGRESS_LINES"
# Seconds between two lines of the same work (default DATA_INTERVAL; training prints each log_interval steps and
# between them after TRAIN_INTERVAL without a line). 0 prints every update: tests use it to see lines at once.
PROGRESS_INTERVAL = "FITLM_PROGRESS_INTERVAL"
DATA_INTERVAL = 5.0
TRAIN_INTERVAL = 30.0


def as_lines(stream: IO[str] | None = None) -> bool:
    """Plain lines rather than a live bar: FITLM_PROGRESS_LINES is set, or `stream` (stderr) is not a terminal."""
    stream = sys.stderr if stream is None else stream
    return bool(os.environ.get(PROGRESS_LINES)) or not (hasattr(stream, "isatty") and stream.isatty())


def interval(default: float) -> float:
    """Seconds between two progress lines: FITLM_PROGRESS_INTERVAL where it is set, else `default`."""
    value = os.environ.get(PROGRESS_INTERVAL)
    try:
        return max(0.0, float(value)) if value else default
    except ValueError:
        return default  # a typo in a display setting must not stop a run


def say(line: str) -> None:
    """One line on stderr, flushed now (stderr may be a fully buffered file under some launchers)."""
    print(line, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """m:ss below an hour, h:mm:ss above (rich's bar writes the same)."""
    s = int(max(0.0, seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def timing(done: float, total: float, elapsed: float) -> str:
    """Elapsed time and the ETA at the mean rate so far ("elapsed 1:02, ETA 13:58"; "ETA -" before anything is
    done)."""
    if done <= 0 or total <= 0:
        return f"elapsed {duration(elapsed)}, ETA -"
    return f"elapsed {duration(elapsed)}, ETA {duration(elapsed / done * max(0.0, total - done))}"


def byte_counts(done: int, total: int) -> str:
    """Both counts in the unit that suits the total: "12.3/45.6 MB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= size:
            return f"{done / size:.1f}/{total / size:.1f} {unit}"
    return f"{done}/{total} B"


def plain_counts(done: int, total: int) -> str:
    return f"{done}/{total}"


class Lines:
    """Lines "<what>: done/total, elapsed …, ETA …": the first update, then one per `every` seconds at most,
    and the last (done reaching total, or `close`)."""

    def __init__(
        self, what: str, total: int, every: float | None = None, counts: Callable[[int, int], str] = plain_counts
    ):
        self.what, self.total, self.counts = what, total, counts
        self.every = interval(DATA_INTERVAL) if every is None else every
        self.start = time.monotonic()
        self.last = -math.inf  # when the last line was printed
        self.done = 0
        self.printed = -1  # `done` as of the last line

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        # the line at the total once: a count past its estimate (compressed input) goes on at the pace
        if (done >= self.total and self.printed < self.total) or now - self.last >= self.every:
            self.last, self.printed = now, done
            counts = self.counts(done, self.total)
            say(f"{self.what}: {counts}, {timing(done, self.total, now - self.start)}")

    def advance(self, n: int) -> None:
        self.update(self.done + n)

    def close(self) -> None:
        """The final count, when the last update was not printed (the work ended short of its estimate)."""
        if self.printed != self.done:
            self.last = -math.inf
            self.update(self.done)


def counted(items: Iterable[_T], total: int, what: str) -> Iterator[_T]:
    """`items`, telling how many have passed on stderr: a transient rich bar on a terminal, `Lines` elsewhere
    (`fitlm ui` reads their "<what>: i/n" prefix)."""
    if as_lines():
        lines = Lines(what, total)
        for i, item in enumerate(items, 1):
            yield item
            lines.update(i)
        lines.close()
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(what, total=total)
        for item in items:
            yield item
            bar.advance(task)
