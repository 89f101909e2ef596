"""The error a user can fix about a checkpoint: a missing, damaged or incompatible checkpoint directory."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the text names the directory or file and what to do."""


class TrainingInterrupted(Exception):
    """SIGTERM arrived: a checkpoint of `step` was written and training stopped (not a user error)."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path
        super().__init__(
            f"stopped by SIGTERM after step {step}; checkpoint {path} is complete. "
            "Run the same command again to resume from it"
        )
