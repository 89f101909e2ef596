"""The one exception type of the data pipeline."""

from __future__ import annotations


class DataError(ValueError):
    """A problem with input text, a tokenizer or packed data. The message names the file and the fix."""
