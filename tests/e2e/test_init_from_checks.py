"""Every check that reads `model.*` judges the model `model.init_from` defines, with a model section of
`init_from` alone (how users fine-tune): a dense, an MoE and a Gemma 2 checkpoint that transformers made, read
as an HF directory, as the fitlm directory `fitlm import` writes and as a GGUF file (its metadata only).

Each check runs through `fitlm plan`, `fitlm train --dry-run` (in process: the CLI's own main()) and the UI's Plan
view, and its message names the checkpoint's value (its head count, its experts, its context), never a default of
the model section the checkpoint replaces. The issue this file is for: expert parallel on an imported Qwen3-MoE
was refused because validation judged `arch: llama` with `num_experts: null`, the schema's defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fitlm.cli import main
from tests.e2e.helpers import fitlm, read_metrics

DENSE = {"hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 6,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128}  # fmt: skip
MOE = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
       "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 512, "max_position_embeddings": 128}  # fmt: skip
GEMMA2 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 128}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    """HF directories made by transformers; the MoE one also imported (a fitlm directory) and exported to GGUF."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("init_from_checks")
    torch.manual_seed(0)
    for name, cls, kwargs in (("dense", "Llama", DENSE), ("moe", "Qwen3Moe", MOE), ("gemma2", "Gemma2", GEMMA2)):
        hf_cfg = getattr(transformers, f"{cls}Config")(**kwargs)
        getattr(transformers, f"{cls}ForCausalLM")(hf_cfg).save_pretrained(root / name)
    assert main(["import", str(root / "moe"), "--out", str(root / "moe-fitlm")]) == 0
    gguf = root / "moe.gguf"
    assert main(["export", str(root / "moe-fitlm"), "--format", "gguf", "--out", str(gguf)]) == 0
    return {"root": root, "dense": root / "dense", "moe": root / "moe", "moe-fitlm": root / "moe-fitlm",
            "moe-gguf": gguf, "gemma2": root / "gemma2", **tiny_corpus}  # fmt: skip


def only_init_from(ckpt: dict[str, Path], name: str, out: Path, **sections) -> Path:
    """A config whose model section is `init_from` alone, on the packed test data; `sections` add keys."""
    cfg: dict = {
        "model": {"init_from": str(ckpt[name])},
        "data": {"train": str(ckpt["train"]), "seq_length": 64},
        "train": {
            "max_steps": 2,
            "micro_batch_size": 2,
            "log_interval": 1,
            "progress": False,
            "output_dir": str(out / "run"),
            "peak_tflops": 1.0,
        },  # fmt: skip
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def ui_plan(config: Path, num_devices: int) -> dict:
    from fitlm.ui.planning import plan_response

    return plan_response({"source": str(config), "device": "cpu", "num_devices": num_devices})


@pytest.mark.parametrize("name", ["moe", "moe-fitlm", "moe-gguf"])
def test_expert_parallel_on_an_imported_moe_is_planned_and_checked(ckpt, name, tmp_path, capsys):
    config = only_init_from(ckpt, name, tmp_path, parallel={"data_parallel": 2, "expert_parallel": 2})
    assert main(["plan", str(config), "--device", "cpu", "--json"]) == 0, capsys.readouterr().err
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert planned["model"]["arch"] == "qwen3_moe" and planned["model"]["hidden_size"] == 64
    assert main(["train", str(config), "--dry-run", "--json"]) == 0, capsys.readouterr().err
    dry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (dry["model"], dry["processes"]) == ("qwen3_moe", 2)
    assert ui_plan(config, 2)["plan"]["model"]["arch"] == "qwen3_moe"
    assert not (tmp_path / "run").exists()


# (checkpoint, config sections, what the message must say: the checkpoint's value, or both values of a conflict)
REFUSED = {
    "tensor parallel vs the checkpoint's heads": (
        "dense",
        {"parallel": {"tensor_parallel": 4}},
        "parallel.tensor_parallel: 4 does not divide model.num_heads=6",
    ),
    "expert parallel on a dense checkpoint": (
        "dense",
        {"parallel": {"data_parallel": 2, "expert_parallel": 2}},
        "model.arch='llama' has none",
    ),
    "expert parallel vs the checkpoint's experts": (
        "moe-gguf",
        {"parallel": {"data_parallel": 3, "expert_parallel": 3}},
        "cannot split model.num_experts=4 experts",
    ),
    "tensor parallel vs an MoE checkpoint's heads": (
        "moe",
        {"parallel": {"tensor_parallel": 4}},
        "parallel.tensor_parallel: 4 does not divide model.num_kv_heads=2",
    ),
    "pipeline stages vs the checkpoint's blocks": (
        "dense",
        {"parallel": {"pipeline_parallel": 3, "micro_batch_num": 3}},
        "3 stages but model.num_layers=2",
    ),
    "sequence length vs the checkpoint's context": (
        "moe-fitlm",
        {"data": {"seq_length": 256}},
        "data.seq_length: 256 exceeds model.max_seq_len=128; lower data.seq_length",
    ),
    "MoE routing settings": (
        "moe",
        {"model": {"router_aux_loss_coef": -0.5}},
        "model.router_aux_loss_coef: must not be negative",
    ),
    "a network key that contradicts the checkpoint": (
        "moe",
        {"model": {"num_experts_per_tok": 3}},
        "model.num_experts_per_tok: config 3 vs weights 2",
    ),
    "LoRA targets vs the checkpoint's modules": (
        "dense",
        {"finetune": {"method": "lora", "lora": {"target_modules": ["w1"]}}},
        "finetune.lora.target_modules: w1 match no linear layer",
    ),
    "LoRA on an MoE router": (
        "moe-gguf",
        {"finetune": {"method": "lora", "lora": {"target_modules": ["gate"]}}},
        "(an MoE router, gate, stays frozen)",
    ),
    "a fitlm.rules row that reads the checkpoint (Gemma 2's soft-capped logits)": (
        "gemma2",
        {"memory": {"loss_chunk_size": 32}},
        "memory.loss_chunk_size: the chunked loss computes plain logits, but model.final_logit_softcap",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_every_model_check_judges_the_checkpoint(ckpt, case, tmp_path, capsys):
    name, sections, says = REFUSED[case]
    config = only_init_from(ckpt, name, tmp_path, **sections)
    devices = str(yaml.safe_load(config.read_text()).get("parallel", {}).get("data_parallel", 1))
    for command in (["plan", "--device", "cpu", "--num-devices", devices], ["train", "--dry-run"], ["train"]):
        assert main([command[0], str(config), *command[1:]]) == 2, (case, command)
        err = capsys.readouterr().err
        assert err.startswith(f"fitlm {command[0]}: error: ") and says in err, (command, err)
        assert f"model.init_from={ckpt[name]}" in err or str(ckpt[name]) in err  # says where model.* came from
    with pytest.raises(ValueError, match=__import__("re").escape(says)):
        ui_plan(config, int(devices))
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_profile_refuses_alike(ckpt, tmp_path, capsys):
    config = only_init_from(ckpt, "dense", tmp_path, parallel={"tensor_parallel": 4})
    assert main(["profile", str(config), "--steps", "2", "--out", str(tmp_path / "profile")]) == 2
    assert "does not divide model.num_heads=6" in capsys.readouterr().err
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize(
    "parallel",
    [
        {"data_parallel": 2, "expert_parallel": 2},
        # expert parallel beside tensor (sequence) parallel, and beside context parallel with ZeRO-1: 4 ranks
        pytest.param(
            {"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True},
            marks=pytest.mark.slow,
            id="ep2-tp2-sp",
        ),
        pytest.param(
            {"data_parallel": 2, "expert_parallel": 2, "context_parallel": 2, "zero_stage": 1},
            marks=pytest.mark.slow,
            id="ep2-cp2-zero1",
        ),
    ],
    ids=lambda p: "ep2" if isinstance(p, dict) else None,
)
def test_expert_parallel_trains_from_an_imported_moe_with_init_from_alone(ckpt, tmp_path, parallel):
    # The run, as a user starts it: `fitlm train` launches the ranks itself.
    config = only_init_from(ckpt, "moe-fitlm", tmp_path, parallel=parallel)
    proc = fitlm("train", config, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert (written["arch"], written["num_experts"], written["init_from"]) == ("qwen3_moe", 4, str(ckpt["moe-fitlm"]))
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2]
