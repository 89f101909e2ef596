"""fitlm.progress (bar on a terminal, lines elsewhere) and the training progress built on it; the CLI runs that
read these lines from a log file while the command runs are in tests/e2e/test_progress_cli.py."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from fitlm import progress
from fitlm.data.prep.output import Progress as DataProgress
from fitlm.progress import PROGRESS_INTERVAL, PROGRESS_LINES, Lines, as_lines, counted, duration, timing
from fitlm.train.progress import TrainProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """time.monotonic for fitlm.progress and fitlm.train.progress, moved by hand."""

    def __init__(self, monkeypatch):
        self.now = 100.0
        monkeypatch.setattr(progress.time, "monotonic", lambda: self.now)


@pytest.fixture(autouse=True)
def _no_forced_lines(monkeypatch):
    monkeypatch.delenv(PROGRESS_LINES, raising=False)
    monkeypatch.delenv(PROGRESS_INTERVAL, raising=False)


def test_lines_where_stderr_is_not_a_terminal_or_where_asked(monkeypatch):
    assert as_lines(io.StringIO()) and not as_lines(Terminal())
    monkeypatch.setenv(PROGRESS_LINES, "1")  # fitlm ui: lines even on a terminal
    assert as_lines(Terminal())


def test_elapsed_and_eta_read_as_a_clock():
    assert duration(0) == "0:00" and duration(62.9) == "1:02" and duration(3723) == "1:02:03"
    assert timing(0, 10, 5) == "elapsed 0:05, ETA -"  # nothing done: no rate yet
    assert timing(5, 10, 10) == "elapsed 0:10, ETA 0:10"
    assert timing(12, 10, 10) == "elapsed 0:10, ETA 0:00"  # past an estimate (compressed input)


def test_lines_come_at_the_pace_asked_and_at_the_end(monkeypatch, capsys):
    clock = Clock(monkeypatch)
    lines = Lines("packing", 10, every=5)
    for t, done in ((0, 1), (1, 2), (4, 3), (6, 4), (7, 9), (8, 10)):
        clock.now = 100 + t
        lines.update(done)
    lines.close()  # the end was printed already
    assert capsys.readouterr().err.splitlines() == [
        "packing: 1/10, elapsed 0:00, ETA 0:00",
        "packing: 4/10, elapsed 0:06, ETA 0:09",
        "packing: 10/10, elapsed 0:08, ETA 0:00",
    ]


def test_counted_prints_lines_off_a_terminal(monkeypatch, capsys):
    monkeypatch.setenv(PROGRESS_INTERVAL, "0")
    assert list(counted(iter("ab"), 2, "x")) == ["a", "b"]
    assert [line.split(",")[0] for line in capsys.readouterr().err.splitlines()] == ["x: 1/2", "x: 2/2"]


def test_data_progress_ends_with_what_was_read_when_it_falls_short(monkeypatch, capsys):
    """Input bytes read can fall short of the files' sizes: the last line is what was read, printed at the end."""
    Clock(monkeypatch)
    with DataProgress(True, 3_000_000) as advance:
        advance(1_000_000)
        advance(1_500_000)  # within the interval: not printed
    err = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in err] == ["packing: 1.0/3.0 MB", "packing: 2.5/3.0 MB"]
    with DataProgress(False, 10) as advance:
        advance(10)
    assert capsys.readouterr().err == ""


def test_training_lines_each_logged_step_and_after_a_quiet_interval(monkeypatch, capsys):
    clock = Clock(monkeypatch)
    with TrainProgress(100) as bar:  # stderr (captured) is no terminal
        clock.now += 10
        bar.update(1, loss=6.5, tokens_per_s=1234.4)
        clock.now += 10
        bar.update(2)  # not logged, 10 s after the last line: nothing
        clock.now += 25
        bar.update(3)  # 35 s without a line: one, with what is known
        bar.update(10, eval_loss=5.25)
    assert capsys.readouterr().err.splitlines() == [
        "train: step 1/100, loss 6.5000, 1,234 tok/s, elapsed 0:10, ETA 16:30",
        "train: step 3/100, loss 6.5000, 1,234 tok/s, elapsed 0:45, ETA 24:15",
        "train: step 10/100, eval loss 5.2500, elapsed 0:45, ETA 6:45",
    ]


def test_a_resumed_runs_eta_counts_from_where_it_resumed(monkeypatch, capsys):
    clock = Clock(monkeypatch)
    with TrainProgress(100) as bar:
        clock.now += 10
        bar.update(51, loss=1.0)  # resumed at step 50: one step in 10 s, 49 to go
    assert capsys.readouterr().err.strip().endswith("elapsed 0:10, ETA 8:10")


def test_the_bar_shows_no_eval_without_a_validation_set():
    out = Terminal()
    console = Console(file=out, force_terminal=True, width=160)
    with TrainProgress(4, console=console) as bar:
        for step in range(1, 5):
            bar.update(step, loss=5.0, tokens_per_s=100.0)
    text = out.getvalue()
    assert "4/4" in text and "loss 5.0000" in text and "100 tok/s" in text
    assert "nan" not in text and "eval" not in text


def test_disabled_progress_prints_nothing(capsys):
    with TrainProgress(3, enabled=False) as bar:
        bar.update(1, loss=1.0)
    assert capsys.readouterr().err == ""
