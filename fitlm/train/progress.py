"""Live progress bar for training (rich), with loss and throughput beside it; silent when disabled."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        # (Any: rich's add_task/update take these as **fields beside their own typed keywords)
        self.fields: dict[str, Any] = {"loss": float("nan"), "eval_loss": float("nan"), "tokens_per_s": 0.0}
        if not enabled:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("eval {task.fields[eval_loss]:.4f}"),
            TextColumn("{task.fields[tokens_per_s]:,.0f} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, **self.fields)

    def __enter__(self) -> "TrainProgress":
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()

    def update(self, step: int, **fields: float) -> None:
        if self.enabled:
            task_fields: dict[str, Any] = fields  # (as self.fields)
            self.progress.update(self.task, completed=step, **task_fields)
