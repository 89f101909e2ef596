"""pydantic's ValidationError as fitlm's messages: each names the dotted key, what is wrong and the fix
(an unknown key gets the closest valid one, or the valid keys of its section)."""

from __future__ import annotations

import difflib
import json

from pydantic import BaseModel, ValidationError

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


def _closest(name: str, choices: list[str]) -> str | None:
    if KEY_ALIASES.get(name) in choices:
        return KEY_ALIASES[name]
    hit = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return hit[0] if hit else None


def schema_errors(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            model: type[BaseModel] = Config
            for part in loc[:-1]:
                ann = model.model_fields.get(part)
                if ann is None or not (isinstance(ann.annotation, type) and issubclass(ann.annotation, BaseModel)):
                    break
                model = ann.annotation
            valid = list(model.model_fields)
            guess = _closest(loc[-1], valid)
            hint = f"did you mean {'.'.join(loc[:-1] + [guess])}?" if guess else f"valid keys here: {', '.join(valid)}"
            out.append(f"{key}: unknown key; {hint}")
        else:
            got = e.get("input")
            got_s = json.dumps(got) if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
            out.append(f"{key}: {e['msg']} (got {got_s}); set it in the YAML or with --set {key}=...")
    return out
