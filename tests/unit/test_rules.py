"""fitlm.rules: every "does not compose" / "needs" rule is one row, refused with its key named where the
row says (config load or launch), rendered into docs/config.md, and kept by `fitlm plan --search`."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitlm import rules
from fitlm.config import ConfigError, validate_dict
from fitlm.docs import RULES_BEGIN, RULES_END
from fitlm.plan.devices import CATALOG
from fitlm.plan.search import candidates
from fitlm.train.preflight import unsupported_options

ROOT = Path(__file__).resolve().parents[2]
MODEL = {
    "hidden_size": 96,
    "num_layers": 2,
    "num_heads": 6,
    "num_kv_heads": 3,
    "intermediate_size": 192,
    "vocab_size": 512,
    "max_seq_len": 64,
}
MOE = {**MODEL, "arch": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32}
EP = {"data_parallel": 2, "expert_parallel": 2}
PROMPTS = {"format": "prompts"}
GRPO = {"objective": "grpo", "grpo": {"num_generations": 2, "reward_funcs": ["length:10"]}}
# One config per row that breaks that row (and, as far as possible, no other).
BREAKS = [
    {"parallel": {"data_parallel": 1, "tensor_parallel": 2, "zero_stage": 1}},
    {"parallel": {"zero_stage": 2}},
    {"parallel": {"context_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 2}},
    {"parallel": {"sequence_parallel": True}},
    {"parallel": {"tensor_parallel": 2}, "memory": {"loss_chunk_size": 32}},
    {"parallel": {"pipeline_parallel": 2, "micro_batch_num": 2}, "memory": {"loss_chunk_size": 32}},
    {"model": {"final_logit_softcap": 30.0}, "memory": {"loss_chunk_size": 32}},
    {"parallel": {"pipeline_parallel": 2, "micro_batch_num": 2}, "memory": {"cpu_offload": True}},
    {"parallel": {"tensor_parallel": 2}, "finetune": {"objective": "dpo"}, "data": {"format": "preference"}},
    {"memory": {"loss_chunk_size": 32}, "finetune": {"objective": "dpo"}, "data": {"format": "preference"}},
    {"parallel": {"context_parallel": 2}, "memory": {"attention_backward": "matmul"}},
    {"parallel": {"tensor_parallel": 2}, "finetune": {"method": "qlora"}},
    {"memory": {"mixed_precision": "O3"}, "finetune": {"method": "qlora"}},
    {"model": {**MOE, "num_kv_heads": 2}, "parallel": {"tensor_parallel": 2}, "memory": {"compile": True}},
    {"model": MOE, "parallel": {"data_parallel": 4, "expert_parallel": 2, "context_parallel": 2, "zero_stage": 2}},
    {"model": MOE, "parallel": EP, "memory": {"cpu_offload": True}},
    {"model": MOE, "parallel": EP, "memory": {"compile": True}},
    {"model": MOE, "parallel": EP, "finetune": {"objective": "dpo"}, "data": {"format": "preference"}},
    {"train": {"observe": {"guards": {"nonfinite": "rollback"}}}, "checkpoint": {"interval": 0}},
    {"train": {"observe": {"guards": {"spike": "rollback"}}}, "checkpoint": {"interval": 0}},
    {"train": {"observe": {"eval_tasks": ["t.jsonl"]}, "eval_interval": 0}},
    {"train": {"observe": {"eval_tasks": ["t.jsonl"]}}, "parallel": {"zero_stage": 3}},
    {"train": {"early_stopping_patience": 2, "eval_interval": 0}},
    {"finetune": {"method": "qlora"}},
    {"train": {"observe": {"tensorboard": True}}},
    {"finetune": GRPO, "data": PROMPTS, "memory": {"cpu_offload": True}},
    {"finetune": GRPO, "data": {**PROMPTS, "valid": "unused"}},
    {"train": {"observe": {"report_to": ["tensorboard"]}}},
    {"train": {"observe": {"report_to": ["wandb"]}}},
    {"train": {"observe": {"report_to": ["mlflow"]}}},
    {"train": {"observe": {"report_to": [], "tensorboard": False}}},
]


def config(overrides: dict) -> dict:
    base = {
        "model": dict(MODEL),
        "data": {"seq_length": 64, "train": "unused"},
        "train": {"micro_batch_size": 4},
        "checkpoint": {"interval": 10},
    }
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return base


def test_every_row_has_a_breaking_case():
    assert len(BREAKS) == len(rules.ROWS)


@pytest.mark.parametrize("index", range(len(rules.ROWS)), ids=[f"{r.key}-{i}" for i, r in enumerate(rules.ROWS)])
def test_each_rule_is_refused_naming_its_key_at_its_stage(index, monkeypatch):
    rule = rules.ROWS[index]
    monkeypatch.setattr(rules, "tensorboard_installed", lambda: False)  # the tensorboard row: a machine without it
    monkeypatch.setattr(rules, "torchao_installed", lambda: False)  # the QLoRA row: a machine without torchao
    monkeypatch.setattr(rules, "installed", lambda module: False)  # the report_to rows: no tracker installed
    data = config(BREAKS[index])
    if rule.stage == "config":
        with pytest.raises(ConfigError) as err:
            validate_dict(data)
        assert f"{rule.key}:" in str(err.value)
    else:
        found = unsupported_options(validate_dict(data))
        assert any(m.startswith(f"{rule.key}:") for m in found), found
    # The same config without the breaking values keeps the rule.
    assert rule not in rules.broken(rules.flatten(validate_dict(config({})).model_dump()), ("config", "launch"))


def test_docs_table_is_generated_from_the_rows():
    page = (ROOT / "docs" / "config.md").read_text()
    block = page.split(RULES_BEGIN, 1)[1].split(RULES_END, 1)[0]
    assert block.strip() == rules.rules_table_markdown().strip(), "docs/config.md rules table is stale: `make docs`"
    assert block.count("\n| `") == len(rules.ROWS)


def test_search_never_proposes_a_refused_combination():
    cfg = validate_dict(
        config(
            {
                "model": {"num_heads": 4, "num_kv_heads": 2, "hidden_size": 128, "intermediate_size": 256},
                "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 4},
            }
        )
    )
    found = candidates(cfg, 4, CATALOG["a100-80g"], max_micro_batch=4)
    assert found
    for c in found:
        s = c.setup
        assert not (s.loss_chunk and (s.tp > 1 or s.pp > 1)), s
        assert not (s.offload and (s.tp > 1 or s.pp > 1)), s
        assert not (s.zero == 1 and (s.tp > 1 or s.pp > 1)) and not (s.zero and s.dp * s.cp == 1), s
    assert any(c.setup.tp > 1 for c in found) and any(c.setup.loss_chunk for c in found)  # both still searched


@pytest.mark.parametrize(
    "model,parallel,fix",
    [
        (MODEL, EP, "has none (model.num_experts is null)"),
        (MOE, {"data_parallel": 3, "expert_parallel": 2}, "must divide parallel.data_parallel=3"),
        ({**MOE, "num_experts": 6}, {"data_parallel": 4, "expert_parallel": 4}, "cannot split model.num_experts=6"),
    ],
)
def test_expert_parallel_degree_is_checked_against_the_model_and_data_parallel(model, parallel, fix):
    with pytest.raises(ConfigError) as err:
        validate_dict(config({"model": model, "parallel": parallel}))
    assert "parallel.expert_parallel:" in str(err.value) and fix in str(err.value)
    validate_dict(config({"model": MOE, "parallel": EP}))  # a valid degree loads
