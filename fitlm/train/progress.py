"""Training progress on stderr (`fitlm train`, `fitlm profile`'s burst): a live rich bar on a terminal, or one
plain line per logged step elsewhere (fitlm.progress decides which); silent when disabled.

A line: "train: step 20/300, loss 5.1234, eval 4.9876, 1,234 tok/s, elapsed 1:02, ETA 13:58". Between two
logged steps, a step that ends fitlm.progress.TRAIN_INTERVAL seconds or more after the last line prints one too,
so slow steps with a long log_interval do not look like a hung run. (Checked as each step ends: no thread to
print while one step runs.)
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from fitlm.progress import TRAIN_INTERVAL, as_lines, interval, say, timing


class TrainProgress:
    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None, what: str = "train"):
        self.enabled, self.total, self.what = enabled, total_steps, what
        self.loss: float | None = None
        self.eval_loss: float | None = None  # None until an evaluation: no validation set shows no eval at all
        self.tokens_per_s: float | None = None
        self.lines = enabled and as_lines(console.file if console else None)
        self.every = interval(TRAIN_INTERVAL)
        self.first: int | None = None  # the step before the first update (a resumed run's ETA counts from there)
        self.start = self.last_line = time.monotonic()
        if not enabled or self.lines:
            return
        self.progress = Progress(
            TextColumn(f"[bold]{what}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self.task = self.progress.add_task(what, total=total_steps, stats="")

    def __enter__(self) -> "TrainProgress":
        self.start = self.last_line = time.monotonic()
        if self.enabled and not self.lines:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and not self.lines:
            self.progress.stop()

    def stats(self) -> str:
        """What is known so far, "loss 5.1234, eval 4.9876, 1,234 tok/s"; nothing for what is not (a run without
        a validation set has no eval; a nan is shown only where the value itself was nan)."""
        parts = [f"loss {self.loss:.4f}"] if self.loss is not None else []
        parts += [f"eval {self.eval_loss:.4f}"] if self.eval_loss is not None else []
        parts += [f"{self.tokens_per_s:,.0f} tok/s"] if self.tokens_per_s is not None else []
        return ", ".join(parts)

    def update(
        self, step: int, loss: float | None = None, eval_loss: float | None = None, tokens_per_s: float | None = None
    ) -> None:
        """Step `step` is done; `loss` and `tokens_per_s` come with a logged step, `eval_loss` after an evaluation.
        Lines: one for a logged step or an evaluation, else one after `every` seconds without any."""
        if not self.enabled:
            return
        if self.first is None:
            self.first = step - 1
        self.loss = loss if loss is not None else self.loss
        self.eval_loss = eval_loss if eval_loss is not None else self.eval_loss
        self.tokens_per_s = tokens_per_s if tokens_per_s is not None else self.tokens_per_s
        if not self.lines:
            self.progress.update(self.task, completed=step, stats=self.stats())
            return
        now = time.monotonic()
        if loss is None and eval_loss is None and now - self.last_line < self.every:
            return
        self.last_line = now
        done = step - self.first
        stats = f"eval loss {eval_loss:.4f}" if eval_loss is not None and loss is None else self.stats()
        eta = timing(done, self.total - self.first, now - self.start)
        say(f"{self.what}: step {step}/{self.total}{', ' + stats if stats else ''}, {eta}")
