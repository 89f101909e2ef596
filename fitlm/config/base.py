"""The config package's base pieces: `ConfigError` (every problem of a config at once) and `Section`, the
pydantic base class of every schema section (unknown keys refused, field docstrings as descriptions)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """One or more problems with a configuration; `str()` lists them all, one per line."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) with the configuration{where}:\n{lines}")


class Section(BaseModel):
    # Attribute docstrings become field descriptions; unknown keys are errors, never ignored.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
