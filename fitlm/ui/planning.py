"""The Plan view's one endpoint: a source (config, model directory, scenario) plus the knobs -> `fitlm plan`'s JSON.

Why the page has no arithmetic of its own: the request is turned into exactly what the CLI would load
(the same YAML, the same `--set` overrides, the same `fitlm.plan.report.plan`), so a number on the page is
the number `fitlm plan --json` prints, and the command shown beside it reproduces it.
"""

from __future__ import annotations

import shlex
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

import fitlm
from fitlm.checkpoint.store import META_FILE, read_meta
from fitlm.config import Config, DataConfig, apply_overrides, load_yaml, parse_override
from fitlm.models.io import read_model_config
from fitlm.plan.device_choice import choose_device
from fitlm.plan.devices import CATALOG
from fitlm.plan.report import plan
from fitlm.run_config import run_config
from fitlm.ui.errors import UIError

# The knobs users turn, in the order the page shows them: (config key, label). Kind, choices and help come
# from the schema, so a new choice of a key appears here without an edit.
KNOBS = (
    ("finetune.method", "Method"),
    ("finetune.objective", "Objective"),
    ("data.seq_length", "Sequence length"),
    ("train.micro_batch_size", "Micro batch"),
    ("train.gradient_accumulation_steps", "Accumulation steps"),
    ("memory.mixed_precision", "Precision level"),
    ("memory.recompute", "Recompute"),
    ("parallel.zero_stage", "ZeRO stage"),
    ("parallel.tensor_parallel", "Tensor parallel"),
    ("parallel.pipeline_parallel", "Pipeline parallel"),
    ("parallel.context_parallel", "Context parallel"),
    ("parallel.expert_parallel", "Expert parallel"),
    ("memory.cpu_offload", "Optimizer offload (CPU)"),
    ("memory.activation_offload", "Activation offload"),
)
ZERO_STAGES = [0, 1, 2, 3]
# Degrees that multiply into the world; data parallel is the devices left over.
MODEL_DEGREES = ("tensor_parallel", "pipeline_parallel", "context_parallel")


class SourceError(UIError):
    """A Plan source that is neither a config file, a model directory or checkpoint, nor a shipped scenario."""


def scenarios_dir() -> Path:
    """The shipped scenario configs (configs/ beside the package in a checkout or sdist)."""
    return Path(fitlm.__file__).resolve().parent.parent / "configs"


def scenarios() -> list[str]:
    d = scenarios_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def _field(key: str):
    model: type[BaseModel] = Config
    *sections, name = key.split(".")
    for s in sections:
        model = model.model_fields[s].annotation  # type: ignore[assignment]  # (a section is a model)
    return model.model_fields[name]


def knob_specs() -> list[dict[str, Any]]:
    """Each knob's key, label, kind (select, number, bool), choices and help, read from the config schema."""
    out = []
    for key, label in KNOBS:
        f = _field(key)
        ann, default = f.annotation, f.get_default(call_default_factory=True)
        choices = [a for a in typing.get_args(ann)] if typing.get_origin(ann) is typing.Literal else None
        if key == "parallel.zero_stage":
            choices = ZERO_STAGES
        kind = "select" if choices else ("bool" if ann is bool else "number")
        out.append({"key": key, "label": label, "kind": kind, "choices": choices, "default": default,
                    "help": f.description or ""})  # fmt: skip
    return out


@dataclass
class PlanRequest:
    source: str  # a config YAML, a model directory / checkpoint / GGUF file, or a scenario name
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE, as `--set`
    device: str | None = None  # catalog name; None = the CLI's default
    num_devices: int | None = None
    search: bool = False
    top: int = 5

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "PlanRequest":
        if not isinstance(body, dict) or not str(body.get("source") or "").strip():
            raise SourceError("source: give a config YAML path, a model directory or checkpoint, or a scenario name")
        overrides = body.get("overrides") or []
        if isinstance(overrides, dict):
            overrides = [f"{k}={_yaml_scalar(v)}" for k, v in overrides.items() if v is not None and v != ""]
        if not isinstance(overrides, list):
            raise UIError("overrides: a list of KEY=VALUE strings, or a mapping of config keys to values")
        n = body.get("num_devices")
        try:
            num = int(n) if n not in (None, "") else None
            top = int(body.get("top") or 5)
        except (TypeError, ValueError):
            raise UIError(f"num_devices {n!r} / top: give whole numbers, e.g. 8") from None
        if num is not None and num < 1:
            raise UIError(f"num_devices {num}: at least 1 device")
        return cls(str(body["source"]).strip(), [str(o) for o in overrides], body.get("device") or None, num,
                   bool(body.get("search")), top)  # fmt: skip


def _yaml_scalar(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def source_data(source: str) -> tuple[dict[str, Any], str | None]:
    """The raw config mapping of a source and the YAML path that `fitlm plan` would take (None: a model, so the
    command names the downloaded YAML)."""
    if source in scenarios() and not Path(source).exists():
        path = scenarios_dir() / f"{source}.yaml"
        return load_yaml(path), str(path)
    p = Path(source).expanduser()
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        return load_yaml(p), str(p)
    if (p / META_FILE).is_file():  # a checkpoint: the config of the run that wrote it (as a resume would train)
        return dict(read_meta(p, verify_files=False)["config"]), None
    if p.is_dir() or (p.is_file() and p.suffix == ".gguf"):  # weights: fine-tune from them, as model.init_from
        try:
            weights = read_model_config(p)  # a directory that holds no model is said here, not planned as one
        except ValueError as e:
            raise SourceError(f"model.init_from: {e}") from None
        # The schema's default sequence length, unless the model is shorter.
        seq = min(DataConfig.model_fields["seq_length"].default, weights.max_seq_len)
        return {"model": {"init_from": str(p.absolute())}, "data": {"seq_length": seq}}, None
    if p.exists():
        raise SourceError(f"{source}: not a config (.yaml), a model directory, a checkpoint or a .gguf file")
    known = ", ".join(scenarios()) or "none shipped"
    raise SourceError(
        f"{source} does not exist: give the path of a config YAML, a model directory or checkpoint, or a "
        f"scenario ({known})"
    )


def _with_devices(data: dict[str, Any], req: PlanRequest) -> list[str]:
    """The overrides, plus parallel.data_parallel = the devices left over by tp × pp × cp when a count is given."""
    overrides = list(req.overrides)
    keys = {".".join(parse_override(o)[0]) for o in overrides}
    if req.num_devices is None or req.search or "parallel.data_parallel" in keys:
        return overrides
    merged = apply_overrides(yaml.safe_load(yaml.safe_dump(data)) or {}, overrides)
    par = merged.get("parallel") or {}
    model_ranks = 1
    for k in MODEL_DEGREES:
        v = par.get(k, 1)
        model_ranks *= v if isinstance(v, int) and v > 0 else 1
    if req.num_devices % model_ranks == 0:  # otherwise the layout check names the valid layouts
        overrides.append(f"parallel.data_parallel={req.num_devices // model_ranks}")
    return overrides


@dataclass
class Resolved:
    cfg: Config  # resolved (model.init_from read when readable) and validated, as `fitlm plan` loads it
    data: dict[str, Any]  # the source's own mapping with the overrides applied: what the YAML download holds
    overrides: list[str]
    path: str | None  # the YAML the commands name (None: a model source, the downloaded YAML)


def resolve(req: PlanRequest) -> Resolved:
    """The request's config as `fitlm plan PATH --set ...` would load it.

    Why the raw mapping travels too: a config dumped in full sets every model key, which model.init_from then
    reads as the user's own and compares with the weights (fitlm.finetune.init_from)."""
    data, path = source_data(req.source)
    overrides = _with_devices(data, req)
    apply_overrides(data, overrides)
    # A checkpoint's config was written by fitlm: keys that moved since are upgraded, as a resume does.
    written = (Path(req.source).expanduser() / META_FILE).is_file()
    cfg, _ = run_config(
        data, path or req.source, written_by_fitlm=written, weights_optional=True, layout=not req.search
    )
    return Resolved(cfg, data, overrides, path)


def commands(req: PlanRequest, overrides: list[str], path: str | None) -> dict[str, str]:
    """The `fitlm plan` and `fitlm train` command lines that reproduce the page."""
    config = path or "plan.yaml"  # a model source: the YAML the page downloads
    sets = [a for o in overrides for a in ("--set", o)]
    flags = (["--device", req.device] if req.device else []) + (
        ["--num-devices", str(req.num_devices)] if req.num_devices else []
    )
    plan_cmd = ["fitlm", "plan", config, *flags, *sets, *(["--search"] if req.search else [])]
    return {"plan": shlex.join(plan_cmd), "train": shlex.join(["fitlm", "train", config, *sets])}


def plan_response(body: dict[str, Any]) -> dict[str, Any]:
    """The page's JSON: the plan (`fitlm plan --json`'s object), the config, its YAML and the commands."""
    req = PlanRequest.from_json(body)
    r = resolve(req)
    dev, device_source = choose_device(req.device, config_device=r.cfg.train.device)  # as `fitlm plan` chooses
    result = {"device_source": device_source, **plan(r.cfg, dev, req.num_devices, search=req.search, top=req.top)}
    return {
        "plan": result,
        "memory_parts": memory_parts(result),
        "knobs": {key: _get(r.cfg, key) for key, _ in KNOBS},
        "yaml": yaml.safe_dump(r.data, sort_keys=False),
        "commands": commands(req, r.overrides, r.path),
        "overrides": r.overrides,
    }


# per_device's components, each with the plan key that names its parts (if any).
COMPONENTS = (("params", "param_parts"), ("grads", None), ("optimizer", None),
              ("activations", "activation_parts"), ("logits", None), ("other", "other_parts"))  # fmt: skip


def memory_parts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The stacked bar's segments: each component, its named parts as segments of their own (and what the
    parts leave of it), with bytes and share of the per-device total."""
    total = result["per_device"]["total"] or 1
    out = []
    for key, named in COMPONENTS:
        value = result["per_device"].get(key, 0)
        parts = list((result.get(named) or {}).items()) if named else []
        for name, nbytes in parts:
            out.append((f"{key}: {name}", nbytes))
        rest = value - sum(n for _, n in parts)
        if rest > 0:
            out.append((f"{key}: the rest" if parts else key, rest))
    return [{"name": n, "bytes": b, "share": b / total} for n, b in out if b > 0]


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for k in key.split("."):
        node = getattr(node, k)
    return node


def devices() -> list[dict[str, Any]]:
    return [{"name": d.name, "memory_bytes": d.memory_bytes, "tflops": d.tflops} for d in CATALOG.values()] + [
        {"name": "cpu", "memory_bytes": None, "tflops": None}
    ]


__all__ = ["PlanRequest", "Resolved", "resolve", "SourceError", "devices", "knob_specs", "plan_response", "scenarios"]
