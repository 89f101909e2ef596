"""Typed run configuration: YAML in, validated `Config` out, every error reported at once.

The package by concern: `schema` and `model_schema` (the pydantic sections; each field's docstring is its
user-facing help, rendered into docs/config.md by `reference`), `loading` (YAML, `--set` overrides, moved
keys, `load_config`, `validate_dict`), `schema_errors` (pydantic's errors as fitlm's messages),
`validation` (the checks across fields and sections) and `base` (`ConfigError`, the section base class).
Every name is re-exported here, so `from fitlm.config import ...` stays the one way in. Validating a config
imports no torch: a family's defaults and refusals come from its torch-free spec (fitlm.models.family_spec).
"""

from fitlm.config.base import ConfigError, Section
from fitlm.config.loading import (
    MOVED_KEYS,
    apply_overrides,
    load_config,
    load_yaml,
    parse_dict,
    parse_override,
    read_config_dict,
    upgrade_moved_keys,
    validate_dict,
)
from fitlm.config.model_schema import ModelConfig, RopeScalingConfig
from fitlm.config.reference import config_reference_markdown
from fitlm.config.schema import (
    PAIR_OBJECTIVES,
    CheckpointConfig,
    Config,
    DataConfig,
    DpoConfig,
    FinetuneConfig,
    GuardsConfig,
    LoraConfig,
    LossScalingConfig,
    MemoryConfig,
    ObserveConfig,
    ParallelConfig,
    SimpoConfig,
    TrainConfig,
)
from fitlm.config.schema_errors import KEY_ALIASES, schema_errors
from fitlm.config.validation import (
    expert_parallel_errors,
    family_errors,
    memory_errors,
    moe_errors,
    objective_errors,
    observe_errors,
    rope_scaling_errors,
    semantic_errors,
    sequence_errors,
    shape_errors,
)

__all__ = [
    "KEY_ALIASES",
    "MOVED_KEYS",
    "PAIR_OBJECTIVES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DpoConfig",
    "FinetuneConfig",
    "GuardsConfig",
    "LoraConfig",
    "LossScalingConfig",
    "MemoryConfig",
    "ModelConfig",
    "ObserveConfig",
    "ParallelConfig",
    "RopeScalingConfig",
    "Section",
    "SimpoConfig",
    "TrainConfig",
    "apply_overrides",
    "config_reference_markdown",
    "expert_parallel_errors",
    "family_errors",
    "load_config",
    "load_yaml",
    "parse_dict",
    "read_config_dict",
    "memory_errors",
    "moe_errors",
    "objective_errors",
    "observe_errors",
    "parse_override",
    "rope_scaling_errors",
    "schema_errors",
    "semantic_errors",
    "sequence_errors",
    "shape_errors",
    "upgrade_moved_keys",
    "validate_dict",
]
