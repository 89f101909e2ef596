"""finetune.grpo: TRL's GRPOConfig names and defaults, and the checks of the batch (counted in completions), the
reward functions and the data format, each naming its key."""

from __future__ import annotations

import pytest

from fitlm.config import ConfigError, validate_dict
from fitlm.train.preflight import unsupported_options

MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 256, "max_seq_len": 64}


def config(grpo: dict | None = None, train: dict | None = None, data_format: str = "prompts", **finetune) -> dict:
    return {
        "model": MODEL,
        "data": {"seq_length": 64, "train": "unused", "format": data_format},
        "train": {"micro_batch_size": 4, **(train or {})},
        "finetune": {
            "objective": "grpo",
            "grpo": {"num_generations": 4, "reward_funcs": ["length"], **(grpo or {})},
            **finetune,
        },
    }


def problems(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate_dict(data)
    return str(err.value)


def test_defaults_are_trls():
    trl = pytest.importorskip("trl")
    ours = validate_dict(config()).finetune.grpo.model_copy(update={"num_generations": 8})
    theirs = trl.GRPOConfig.__dataclass_fields__  # the declared defaults (an instance checks this machine's bf16)
    for key in (
        "num_generations",
        "max_completion_length",
        "temperature",
        "top_p",
        "top_k",
        "beta",
        "epsilon",
        "epsilon_high",
        "loss_type",
        "scale_rewards",
        "importance_sampling_level",
        "num_iterations",
        "mask_truncated_completions",
        "reward_weights",
    ):
        assert getattr(ours, key) == theirs[key].default, key


def test_a_valid_grpo_config_loads_and_launches():
    cfg = validate_dict(config(train={"gradient_accumulation_steps": 2}, grpo={"num_generations": 8}))
    assert cfg.finetune.grpo.num_generations == 8
    assert unsupported_options(cfg) == []


@pytest.mark.parametrize(
    "data,key,fix",
    [
        (config({"num_generations": 1}), "finetune.grpo.num_generations", "must be at least 2"),
        (config({"num_generations": 3}), "finetune.grpo.num_generations", "use num_generations in [2, 4]"),
        (
            config({"num_generations": 8}) | {"parallel": {"data_parallel": 3}},
            "finetune.grpo.num_generations",
            "= 12 completions",
        ),
        (
            config({"num_generations": 4}, {"micro_batch_size": 2}) | {"parallel": {"data_parallel": 2}},
            "finetune.grpo.num_generations",
            "each data-parallel rank samples whole groups",
        ),
        (config({"reward_funcs": []}), "finetune.grpo.reward_funcs", "list at least one"),
        (config({"reward_weights": [1.0, 2.0]}), "finetune.grpo.reward_weights", "2 weights for 1 reward_funcs"),
        (config(data_format="chat"), "finetune.objective", "data.format: prompts"),
        (config(objective="sft"), "finetune.objective", "set finetune.objective: grpo"),
        (config({"loss_type": "cispo"}), "finetune.grpo.loss_type", "dapo"),
        (config({"scale_rewards": True}), "finetune.grpo.scale_rewards", "group"),
    ],
)
def test_bad_grpo_settings_name_the_key_and_the_fix(data, key, fix):
    message = problems(data)
    assert f"{key}" in message and fix in message, message


def test_the_plan_counts_grpo_rollout_with_no_caveat_note():
    """The rollout phase is planned (fitlm.plan.grpo; tests/unit/test_plan_grpo.py): no 'not counted' note."""
    from fitlm.plan.devices import CATALOG
    from fitlm.plan.report import plan

    result = plan(validate_dict(config()), CATALOG["a100-80g"], 1)
    assert result["finetune"]["grpo"]["kv_cache_bytes"] > 0
    assert not any("grpo" in n for n in result.get("notes", []))
