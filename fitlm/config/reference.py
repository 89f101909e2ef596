"""docs/config.md's config reference, rendered from the schema's field docstrings (`make docs`)."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel

from fitlm.config.schema import Config


def config_reference_markdown() -> str:
    """The README's config reference, rendered from the field docstrings."""

    def fmt(v: Any) -> str:
        if isinstance(v, BaseModel):
            return ""
        return "`" + json.dumps(v) + "`" if not isinstance(v, str) else f"`{v}`"

    lines = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            key = f"{prefix}{name}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, key + ".")
                continue
            default = field.get_default(call_default_factory=True)
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{key}` | {fmt(default)} | {desc} |")
            # An optional section (e.g. model.rope_scaling: null or a mapping): its keys, when given.
            for arg in typing.get_args(ann):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg, key + ".")

    walk(Config, "")
    return "\n".join(lines) + "\n"
