"""`fitlm config import`: MindSpore Transformers YAML -> fitlm config, a note for every key not carried
over exactly, clear refusals, and an atomic write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fitlm.cli import main
from fitlm.config import ConfigError, load_config
from fitlm.plan.config_import import ConfigImportError, _leaves, import_file, translate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mindformers" / "llama2_7b.yaml"
SMALL = {
    "model": {
        "model_config": {
            "type": "LlamaConfig",
            "seq_length": 512,
            "hidden_size": 256,
            "num_layers": 4,
            "num_heads": 8,
            "n_kv_heads": 4,
            "vocab_size": 1024,
            "intermediate_size": 688,
            "compute_dtype": "bfloat16",
            "param_init_type": "float32",
        }
    },
    "parallel_config": {"data_parallel": 4, "model_parallel": 1, "pipeline_stage": 1},
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_example_imports_to_a_config_that_plans_as_llama2_7b(tmp_path, capsys):
    from fitlm.plan.devices import CATALOG
    from fitlm.plan.report import plan

    out = tmp_path / "llama2.yaml"
    assert main(["config", "import", str(EXAMPLE), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    cfg = load_config(out)
    p, m, t = cfg.parallel, cfg.memory, cfg.train
    assert (p.data_parallel, p.tensor_parallel, p.pipeline_parallel, p.sequence_parallel) == (2, 2, 2, True)
    assert p.micro_batch_num == 8 and t.micro_batch_size == 8  # batch_size 1 per pipeline micro batch × 8
    assert (m.mixed_precision, m.half_dtype, m.recompute) == ("O2", "fp16", "full")
    assert m.loss_scaling.initial_scale == 65536 and m.loss_scaling.growth_interval == 1000
    assert cfg.model.ffn_size == 11008 and cfg.data.seq_length == 4096  # multiple_of 256 rule
    assert (t.lr, t.min_lr, t.max_steps, t.warmup_steps) == (3e-4, 3e-5, 2000, 60)
    assert cfg.checkpoint.interval == 500 and cfg.checkpoint.keep_last == 3
    result = plan(cfg, CATALOG["ascend-910b"])
    assert 6.6e9 < result["model"]["params"] < 6.8e9 and result["fits"] is True
    # Notes name the keys, on stderr and as comments in the written file.
    for key in (
        "parallel_config.gradient_aggregation_group",
        "context.max_device_memory",
        "runner_config.sink_mode",
        "parallel.enable_parallel_optimizer",
        "model.model_config.softmax_compute_type",
        "load_checkpoint",
    ):
        assert f"note: {key}: " in err and f"# note: {key}: " in out.read_text()


def test_every_source_key_is_translated_or_noted():
    source = yaml.safe_load(EXAMPLE.read_text())
    _, notes = translate(source, str(EXAMPLE))
    noted = {n["key"] for n in notes}
    leaves = set(_leaves(source))
    assert noted <= leaves | {"runner_wrapper.scale_sense"}  # notes name real keys
    translated = {
        "model.model_config.hidden_size",
        "model.model_config.num_layers",
        "parallel_config.data_parallel",
        "recompute_config.recompute",
        "optimizer.beta2",
        "lr_schedule.total_steps",
        "runner_config.batch_size",
    }
    assert not translated & noted
    silent = leaves - noted - translated
    # What is neither noted nor in the list above is translated exactly (checked by the previous test).
    assert all(
        k.split(".")[0]
        in {
            "model",
            "parallel_config",
            "recompute_config",
            "runner_config",
            "runner_wrapper",
            "optimizer",
            "lr_schedule",
            "callbacks[1]",
            "seed",
            "output_dir",
        }
        or k.startswith("callbacks[1]")
        for k in silent
    ), sorted(silent)


def test_json_lists_the_notes_and_lora_pet_config_becomes_finetune_lora(tmp_path, capsys):
    data = {
        **SMALL,
        "parallel_config": {**SMALL["parallel_config"], "context_parallel": 2},
        "some_new_block": {"flag": True},
    }
    data["model"] = {
        "model_config": {
            **SMALL["model"]["model_config"],
            "pet_config": {
                "pet_type": "lora",
                "lora_rank": 16,
                "lora_alpha": 32,
                "lora_dropout": 0.05,
                "target_modules": ".*wq|.*wv|.*w2",
            },
        }
    }
    src = _write(tmp_path / "run.yaml", data)
    out = tmp_path / "fitlm.yaml"
    assert main(["config", "import", str(src), "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cfg = load_config(out)
    assert result["config"] == cfg.to_dict()
    f = cfg.finetune
    assert f.method == "lora" and (f.lora.r, f.lora.alpha, f.lora.dropout) == (16, 32.0, 0.05)
    assert sorted(f.lora.target_modules) == ["down_proj", "q_proj", "v_proj"]
    assert cfg.memory.mixed_precision == "O2" and cfg.memory.half_dtype == "bf16"
    assert cfg.parallel.data_parallel == 8  # context parallel folded into data parallel: 8 devices still
    keys = {n["key"] for n in result["notes"]}
    assert {
        "parallel_config.context_parallel",
        "some_new_block.flag",
        "model.model_config.pet_config.target_modules",
    } <= keys


def test_refusals_name_the_file_or_key_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "out.yaml"
    cases = {
        "not yaml": (tmp_path / "run.json", None, "not a YAML file"),
        "missing": (tmp_path / "absent.yaml", None, "does not exist"),
        "malformed": (tmp_path / "bad.yaml", "model: [unclosed", "malformed YAML at line"),
        "no model_config": (
            tmp_path / "nomodel.yaml",
            {"runner_config": {"batch_size": 1}},
            "model.model_config is missing",
        ),
        "unknown type": (
            tmp_path / "moe.yaml",
            {"model": {"model_config": {**SMALL["model"]["model_config"], "type": "DeepseekV3Config"}}},
            "model.model_config.type: DeepseekV3Config is not a model fitlm has",
        ),
        "bad layout": (tmp_path / "tp3.yaml", {**SMALL, "parallel_config": {"model_parallel": 3}}, "tensor_parallel"),
    }
    for name, (src, content, message) in cases.items():
        if isinstance(content, dict):
            _write(src, content)
        elif content is not None:
            src.write_text(content)
        assert main(["config", "import", str(src), "--out", str(out)]) == 2, name
        assert message in capsys.readouterr().err, name
        assert not out.exists() and not list(tmp_path.glob(".out.yaml.*")), name


def test_an_existing_output_is_kept_unless_forced(tmp_path, capsys):
    src = _write(tmp_path / "run.yaml", SMALL)
    out = tmp_path / "out.yaml"
    out.write_text("mine\n")
    assert main(["config", "import", str(src), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "mine\n"
    with pytest.raises(ConfigImportError, match="already exists"):
        import_file(src, out)
    assert main(["config", "import", str(src), "--out", str(out), "--force"]) == 0
    cfg = load_config(out)
    assert cfg.model.num_kv_heads == 4 and cfg.parallel.data_parallel == 4 and cfg.memory.mixed_precision == "O2"


def test_invalid_translation_lists_every_problem():
    bad = {"model": {"model_config": {**SMALL["model"]["model_config"], "hidden_size": 250, "seq_length": 0}}}
    with pytest.raises(ConfigError) as e:
        translate(bad, "bad.yaml")
    text = str(e.value)
    assert "model.hidden_size" in text and "data.seq_length" in text and "MindFormers YAML" in text
