"""From YAML to a validated `Config`: reading the file, `--set` overrides, keys that moved (refused with
their new place, or upgraded in configs fitlm wrote), schema and semantic checks, every problem at once."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fitlm.config.base import ConfigError
from fitlm.config.schema import Config, ObserveConfig
from fitlm.config.schema_errors import schema_errors
from fitlm.config.validation import semantic_errors


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, turning parse errors into a ConfigError that names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist: pass the path of a YAML file"], str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"malformed YAML{where}: {problem}; fix the syntax there"], str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"the top level must be a mapping of sections (model:, data:, ...), got {type(data).__name__}"], str(path)
        )
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML, so 1e-4, true, [x, y] work)."""
    if "=" not in item:
        raise ConfigError([f"--set {item!r} needs the form key.path=value, e.g. --set train.lr=1e-4"])
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads 1e-4 as a string; numbers written that way are meant as numbers.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return [k for k in key.strip().split(".") if k], value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
    return data


# Keys that moved to a section by concern: a config that still uses the old key is refused naming the new one.
MOVED_KEYS = {f"train.{k}": f"train.observe.{k}" for k in ObserveConfig.model_fields}


def _without_moved_keys(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`data` without keys that moved (so the rest is still checked), and one error per moved key."""
    errs: list[str] = []
    train = data.get("train")
    if not isinstance(train, dict):
        return data, errs
    for old, new in MOVED_KEYS.items():
        key = old.split(".", 1)[1]
        if key in train:
            errs.append(
                f"{old}: moved to {new} (the run's observers have their own section); write it under "
                f"train: observe: in the YAML, or `--set {new}=...`"
            )
    return {**data, "train": {k: v for k, v in train.items() if f"train.{k}" not in MOVED_KEYS}}, errs


def upgrade_moved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A config that fitlm itself wrote before keys moved (a model directory's or a checkpoint's config.yaml),
    with each old key moved to its new place: files fitlm wrote stay readable; users get told (validate_dict)."""
    train = data.get("train")
    if not isinstance(train, dict) or not any(f"train.{k}" in MOVED_KEYS for k in train):
        return data
    observe = dict(train.get("observe") or {})
    kept = {}
    for k, v in train.items():
        if f"train.{k}" in MOVED_KEYS:
            observe.setdefault(k, v)
        else:
            kept[k] = v
    return {**data, "train": {**kept, "observe": observe}}


def _key_path(data: dict[str, Any], loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The part of a pydantic error's location that is a key of `data` (not a list index or a union member)."""
    path: list[str] = []
    node: Any = data
    for part in loc:
        if not (isinstance(node, dict) and part in node):
            break
        path.append(part)
        node = node[part]
    return tuple(path)


def _semantic_errors_beside(data: dict[str, Any], err: ValidationError) -> list[str]:
    """The semantic problems of the rest of a config whose schema check failed, so one run reports both: the
    keys in error are left out (their defaults stand in) and a message naming one of them is dropped, as it
    would judge a default the user did not write. `[]` when no key could be left out."""
    bad = {p for p in (_key_path(data, e["loc"]) for e in err.errors()) if p}
    if not bad:
        return []
    rest = copy.deepcopy(data)
    for path in sorted(bad, key=len, reverse=True):  # a key before the section holding it
        node = rest
        for part in path[:-1]:
            node = node[part]
        node.pop(path[-1], None)
    try:
        cfg = Config.model_validate(rest)
    except ValidationError:
        return []  # what is left still fails its schema: its problems are among those already reported
    # by the key's own name, so messages that say `num_heads` for model.num_heads count too
    names = re.compile("|".join(rf"\b{re.escape(p[-1])}\b" for p in bad))
    return [m for m in semantic_errors(cfg) if not names.search(m)]


def parse_dict(
    data: dict[str, Any], source: str | None = None, written_by_fitlm: bool = False, semantic: bool = True
) -> tuple[Config, list[str]]:
    """The schema pass over a raw mapping: (config, problems found so far). Raises ConfigError when the schema
    fails, with the semantic problems of the rest beside them (`semantic`: False when the model section is not
    the one the run trains, model.init_from's, so no check judges defaults the checkpoint replaces). Returns the
    moved keys' problems, which the caller reports with the semantic ones (all at once)."""
    data, moved = _without_moved_keys(upgrade_moved_keys(data) if written_by_fitlm else data)
    try:
        return Config.model_validate(data), moved
    except ValidationError as e:
        beside = _semantic_errors_beside(data, e) if semantic else []
        raise ConfigError(moved + schema_errors(e) + beside, source) from None


def validate_dict(data: dict[str, Any], source: str | None = None, written_by_fitlm: bool = False) -> Config:
    """Validate a raw mapping; raises ConfigError listing every problem found. `written_by_fitlm`: a config
    fitlm wrote (model directory, checkpoint) whose moved keys are upgraded instead of refused. A config whose
    model section is `model.init_from` is validated by fitlm.run_config, after the checkpoint is read."""
    cfg, moved = parse_dict(data, source, written_by_fitlm)
    errs = moved + semantic_errors(cfg)
    if errs:
        raise ConfigError(errs, source)
    return cfg


def read_config_dict(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The raw mapping of `path` (YAML; {} for None) with the `--set` overrides applied, not yet validated."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(data, list(overrides or []))
    return data


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, written_by_fitlm: bool = False
) -> Config:
    """Load `path` (YAML), apply `--set` overrides, validate. Raises ConfigError with all problems.
    `written_by_fitlm`: the config.yaml of a model directory or run (see validate_dict)."""
    data = read_config_dict(path, overrides)
    return validate_dict(data, str(path) if path is not None else None, written_by_fitlm)
