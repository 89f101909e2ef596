"""pydantic's ValidationError as fitlm's messages: each names the dotted key, what is wrong and the fix
(an unknown key gets the closest valid one, or the valid keys of its section)."""

from __future__ import annotations

import difflib
import json
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from fitlm.config.schema import Config

KEY_ALIASES = {
    "learning_rate": "lr",
    "max_grad_norm": "grad_clip",
    "lr_scheduler_type": "lr_schedule",
    "per_device_train_batch_size": "micro_batch_size",
    "micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation": "gradient_accumulation_steps",
    "warmup": "warmup_steps",
    "train_iters": "max_steps",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "max_position_embeddings": "max_seq_len",
}

# pydantic's error types of a numeric bound (Field(ge=...), gt, le, lt)
_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")


def _closest(name: str, choices: list[str]) -> str | None:
    if KEY_ALIASES.get(name) in choices:
        return KEY_ALIASES[name]
    hit = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return hit[0] if hit else None


def _section(annotation: object) -> type[BaseModel] | None:
    """The section class of a field's annotation: `RopeScalingConfig` itself, or in `RopeScalingConfig | None`."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _field_at(loc: list[str]) -> tuple[type[BaseModel], FieldInfo | None]:
    """The section holding the key at `loc` (as deep as `loc` names sections) and the key's field there."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        inner = _section(field.annotation) if field is not None else None
        if inner is None:
            return model, None
        model = inner
    return model, model.model_fields.get(loc[-1])


def _json(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


def _bounds_in_words(field: FieldInfo) -> str:
    """A field's constraints as the message says them: `must be at least 1`, `must not be negative`, `must be
    positive`, `must be between 0 and 1`, `must be above 0 and below 1`; `or null` where null is valid too."""
    b = {k: getattr(m, k) for m in field.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
    num = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in b.items()}
    if b.keys() == {"ge", "le"}:
        words = f"be between {num['ge']} and {num['le']}"
    elif b == {"ge": 0}:
        words = "not be negative"
    elif b == {"gt": 0}:
        words = "be positive"
    else:
        phrases = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
        words = "be " + " and ".join(f"{phrases[k]} {num[k]}" for k in ("ge", "gt", "le", "lt") if k in b)
    nullable = type(None) in typing.get_args(field.annotation)
    return f"must {words}" + (" or null" if nullable else "")


def _unknown_key(loc: list[str]) -> str:
    model, _ = _field_at(loc)
    valid = list(model.model_fields)
    guess = _closest(loc[-1], valid)
    hint = f"did you mean {'.'.join(loc[:-1] + [guess])}?" if guess else f"valid keys here: {', '.join(valid)}"
    return f"{'.'.join(loc)}: unknown key; {hint}"


def schema_errors(err: ValidationError) -> list[str]:
    """One message per pydantic error: unknown keys with the closest valid one, a value outside its field's
    bounds with the whole valid range and the default, any other error with pydantic's words and the key."""
    out = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        key = ".".join(loc)
        _, field = _field_at(loc)
        if e["type"] == "extra_forbidden":
            out.append(_unknown_key(loc))
        elif e["type"] in _BOUNDS and field is not None:
            default = _json(field.get_default(call_default_factory=True))
            out.append(f"{key}: {_bounds_in_words(field)} (got {_json(e.get('input'))}); the default is {default}")
        else:
            out.append(f"{key}: {e['msg']} (got {_json(e.get('input'))}); set it in the YAML or with --set {key}=...")
    return out
