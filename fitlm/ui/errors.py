"""The page's input errors: a ValueError of fitlm's, so the app answers them 400 with the message as written."""

from __future__ import annotations


class UIError(ValueError):
    """A request the user can fix (a missing field, a run that is not running, ...); the message names the fix."""


__all__ = ["UIError"]
