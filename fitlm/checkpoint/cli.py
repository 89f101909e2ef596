"""`fitlm ckpt ...`: checkpoint commands (argument parsing only; the work is in fitlm.checkpoint)."""

from __future__ import annotations


def add_commands(sub) -> None:
    """Registered by fitlm.cli; `fitlm ckpt inspect|merge` arrive with the checkpoint work."""
