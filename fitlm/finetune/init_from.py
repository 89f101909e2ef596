"""`model.init_from` resolved into the config: the one rule `fitlm plan`, `profile`, `train` and
`train --dry-run` all apply (and `fitlm config show`, so what it prints can be used as a config).

With model.init_from the weights define the network: the model keys the user did not set are taken
from the weights, the ones the user did set (in the YAML or with --set) must agree with them, and keys
that only shape a random initialisation (init_std) never conflict. "Did set" is pydantic's
`model_fields_set`, which only a config parsed from the user's own mapping carries: a config dumped
with `to_dict()`/`to_yaml()` and validated again has *every* key set. So a config is resolved before
anything serialises it (the profile burst, config.yaml in output_dir, a checkpoint's meta), and the
resolution is idempotent: a config already resolved from the same weights sets every key to the
weights' value, so it is accepted again (the torchrun relaunch, a resume from output_dir/config.yaml).

Lives in fitlm.finetune (which imports neither train, plan nor profile) so that all three can import it.
"""

from __future__ import annotations

from fitlm.config import Config, ConfigError, ModelConfig, parse_dict, semantic_errors
from fitlm.models.hf import HFFormatError
from fitlm.models.io import ModelDirError, read_model_config

# Model keys that only say how training starts or balances an MoE's routing, not what the network is: the user's
# always stand (router_aux_loss_coef is read from the checkpoint where the user leaves it unset).
# Every other model key describes the network (a key added to ModelConfig does too, by default).
INIT_ONLY = (
    "init_from",
    "init_std",
    "router_aux_loss_coef",
    "moe_balance",
    "router_bias_update_rate",
    "capacity_factor",
)
# Keys whose null means "derived" (num_heads, the family's default width, hidden_size / num_heads) are
# compared by their resolved value (a ModelConfig property), so writing a default out in full is no conflict.
RESOLVED = {"num_kv_heads": "kv_heads", "intermediate_size": "ffn_size", "head_dim": "head_size"}


def shape_conflicts(m: ModelConfig, weights: ModelConfig) -> list[str]:
    """'model.KEY: config X vs weights Y' for each network key the user set that the weights contradict."""
    out = []
    for key in sorted(m.model_fields_set - set(INIT_ONLY)):
        attr = RESOLVED.get(key, key)
        if getattr(m, attr) != getattr(weights, attr):
            out.append(f"model.{key}: config {getattr(m, attr)!r} vs weights {getattr(weights, attr)!r}")
    return out


def read_init_from(path: str) -> ModelConfig:
    """The model section behind model.init_from (a fitlm model or run directory, an HF directory's config.json,
    a GGUF file's metadata; no weights read); ConfigError naming the key when it cannot be read."""
    try:
        return read_model_config(path)
    except (OSError, ModelDirError, HFFormatError) as e:  # say which key names the unreadable path
        raise ConfigError([f"model.init_from: {e}"]) from None


def merge_init_from(cfg: Config, weights: ModelConfig) -> Config:
    """`cfg` with its network taken from `weights` (model.init_from's), schema-checked only: the caller runs the
    semantic checks once, on this result (fitlm.run_config). ConfigError naming every model key the user set
    that differs from the weights, with both values."""
    m = cfg.model
    diffs = shape_conflicts(m, weights)
    if diffs:
        raise ConfigError(
            [
                f"model.init_from: {m.init_from} does not match the model section ({'; '.join(diffs)}); "
                "remove those keys to take them from the weights, or make them match"
            ]
        )
    # the network from the weights; the start, and the routing's training keys the user set
    user = {k: getattr(m, k) for k in INIT_ONLY if k in ("init_from", "init_std") or k in m.model_fields_set}
    merged = weights.model_copy(update=user)
    # Through the schema again, so every key reads as set: the result is resolved (idempotent, see above).
    return parse_dict(cfg.model_copy(update={"model": merged}).to_dict(), f"model.init_from={m.init_from}")[0]


def resolve_init_from(cfg: Config, weights: ModelConfig | None = None) -> Config:
    """`cfg` with its model section taken from model.init_from (unchanged without it), validated: ConfigError
    naming every model key the user set that differs from the weights, or what the real model makes invalid.
    `weights`: the model section already read from model.init_from (see resolve_if_readable); read when None."""
    if not cfg.model.init_from:
        return cfg
    merged = merge_init_from(cfg, weights or read_init_from(cfg.model.init_from))
    # Rules such as data.seq_length <= model.max_seq_len now see the real model.
    errs = semantic_errors(merged)
    if errs:
        raise ConfigError(errs, f"model.init_from={cfg.model.init_from}")
    return merged


def resolve_if_readable(cfg: Config) -> tuple[Config, str | None]:
    """For commands that may describe a model whose weights are not on this machine (`fitlm plan`,
    `fitlm config show`): resolved as above when model.init_from can be read, else `cfg` as written and a
    note saying so. A config that contradicts readable weights, or that the real model makes invalid, is
    still an error, as in training."""
    if not cfg.model.init_from:
        return cfg, None
    try:
        weights = read_model_config(cfg.model.init_from)
    except (OSError, ValueError) as e:
        return cfg, (
            f"model.init_from: {cfg.model.init_from} could not be read ({str(e).splitlines()[-1].strip()}); "
            "the model section is used as written"
        )
    return resolve_init_from(cfg, weights), None
