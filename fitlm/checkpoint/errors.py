"""The error a user can fix about a checkpoint: a missing, damaged or incompatible checkpoint directory."""

from __future__ import annotations

import signal


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the text names the directory or file and what to do."""


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT (`signum`) arrived: training stopped after `step`, with a final checkpoint at `path`, or
    none when checkpoint.save_on_signal is false (`rerun` then says what a rerun starts from). Not a user error:
    the CLI exits with 128 + signum, as a process ended by that signal would."""

    def __init__(self, step: int, path: str | None, signum: int = signal.SIGTERM, rerun: str = ""):
        self.step, self.path, self.signum = step, path, int(signum)
        name = signal.Signals(self.signum).name
        if path is not None:  # `rerun` only where the same command would not resume (checkpoint.resume: never)
            text = f"stopped by {name} after step {step}; checkpoint {path} is complete. " + (
                rerun or f"Run the same command again to resume from step {step}"
            )
        else:
            text = (
                f"stopped by {name} after step {step}; nothing was saved (checkpoint.save_on_signal is false; "
                f"set it to true to save on a stop): {rerun}"
            )
        super().__init__(text)
