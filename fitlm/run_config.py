"""The run's config in one pass: load, resolve `model.init_from`, validate everything once, then run.

Every command that runs or describes a run (`fitlm train` and its `--dry-run`, `plan`, `profile`,
`config show`, the UI's Plan view and its Start button) loads its config here, so every check that reads
`model.*` judges the model the run will train: with `model.init_from` that is the checkpoint's (a fitlm model
or run directory, an HF directory's config.json, a GGUF file's metadata; no weights are read), never the
schema's defaults that the checkpoint replaces. The checks are the config's semantic checks (shapes, the
family's own refusals, MoE routing and expert parallel, sequence length against max_seq_len, fitlm.rules)
and the layout's model-dependent ones (tensor parallel divides the heads, MLP and vocabulary; pipeline stages
fit the blocks): one list, reported at once. What depends on the processes actually started (the world size,
the launch-stage rules, the output directory) is fitlm.train.preflight's `launch_problems`, checked where the
run starts.

A new check of a config has one home: `config_problems` (it sees the resolved model), or preflight's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitlm.config import Config, ConfigError, parse_dict, read_config_dict, semantic_errors, validate_dict
from fitlm.finetune.init_from import merge_init_from, read_init_from
from fitlm.parallel.layout import pp_problems, tp_problems


def config_problems(cfg: Config, layout: bool = True) -> list[str]:
    """Every problem of a config whose model section is the one the run trains (resolved), at once: the
    semantic checks, LoRA's targets and (`layout`) the layout's model-dependent ones, for the layout the
    config declares (`fitlm plan --search` leaves those out: it looks for a layout that has none)."""
    errs = semantic_errors(cfg)
    if not errs:  # a model section that cannot build has no modules to name
        errs += lora_target_problems(cfg)
    return errs + tp_problems(cfg, cfg.parallel.tensor_parallel) + pp_problems(cfg) if layout else errs


def lora_target_problems(cfg: Config) -> list[str]:
    """finetune.lora.target_modules against the modules of the model the run trains, built on the meta device
    (a structure, no storage: instant for any size), as the trainer adapts it."""
    if not cfg.finetune.adapters:
        return []
    import torch

    from fitlm.finetune.apply import refuse_unshardable_adapters
    from fitlm.finetune.errors import FinetuneError
    from fitlm.finetune.lora import apply_lora
    from fitlm.registry import build_model

    lora = cfg.finetune.lora
    with torch.device("meta"):
        model = build_model(cfg.model)
    try:
        apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules)
        refuse_unshardable_adapters(model, cfg)
    except FinetuneError as e:
        return [str(e)]
    return []


def _init_from(data: dict[str, Any]) -> str | None:
    model = data.get("model")
    value = model.get("init_from") if isinstance(model, dict) else None
    return str(value) if value else None


def run_config(
    data: dict[str, Any],
    source: str | None = None,
    *,
    written_by_fitlm: bool = False,
    weights_optional: bool = False,
    layout: bool = True,
) -> tuple[Config, str | None]:
    """(resolved config, note) from a raw mapping (YAML + overrides); ConfigError with every problem.

    `weights_optional`: for commands that may describe a model whose weights are not on this machine (`fitlm
    plan`, `config show`): an unreadable model.init_from gives the config as written and a note saying so.
    `layout`: check the declared layout's model-dependent rules too (see config_problems)."""
    init = _init_from(data)
    if not init:
        cfg, errs = parse_dict(data, source, written_by_fitlm)
        errs += config_problems(cfg, layout)  # the semantic checks (once) and the layout's model rules
    else:
        cfg, errs = parse_dict(data, source, written_by_fitlm, semantic=False)
        try:
            weights = read_init_from(init)
        except ConfigError as e:
            if not weights_optional:
                raise ConfigError(e.problems, source) from None
            cfg = validate_dict(data, source, written_by_fitlm)
            reason = e.problems[0].splitlines()[-1].strip()
            return cfg, f"{reason}; could not be read, so the model section is used as written"
        try:
            cfg = merge_init_from(cfg, weights)
        except ConfigError as e:
            raise ConfigError(errs + e.problems, source) from None
        errs += config_problems(cfg, layout)
        source = f"{source or 'the config'} (model.* read from model.init_from={init})"
    if errs:
        raise ConfigError(errs, source)
    return cfg, None


def load_run_config(
    path: str | Path | None, overrides: list[str] | None = None, *, weights_optional: bool = False, layout: bool = True
) -> tuple[Config, str | None]:
    """`path` (YAML) with the `--set` overrides, resolved and validated once (see run_config)."""
    data = read_config_dict(path, overrides)
    source = str(path) if path is not None else None
    return run_config(data, source, weights_optional=weights_optional, layout=layout)


__all__ = ["config_problems", "load_run_config", "run_config"]
