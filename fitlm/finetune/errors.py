"""The one error type of fine-tuning, import and merge: a user-fixable input, printed as one paragraph by the CLI."""

from __future__ import annotations


class FinetuneError(ValueError):
    """A fine-tuning setting, adapter or imported model that cannot be used; the message names the fix."""
