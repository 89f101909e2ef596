"""Tensor parallel on a mixture of experts as a user runs it: a Qwen2-MoE checkpoint that transformers made (a
shared expert in every routed block, a dense block among them), fine-tuned from a config whose model section is
`init_from` alone, under `tensor_parallel: 2` with sequence parallel (`fitlm train` launches the two processes
itself), each expert split on its width (fitlm.parallel.expert_tensor_parallel). Full fine-tuning and LoRA on
attention, the experts, the shared expert and the dense MLP each equal the one-process run of the same config:
losses and gradient norms step for step, and the saved model (full) or adapter (LoRA) at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import fitlm, hf_moe, pack_chat, read_metrics, write_config

STEPS = 3
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
TP = {"tensor_parallel": 2, "sequence_parallel": True}


def _config(hf: Path, packed: Path, out: Path, parallel: dict, lora: bool) -> dict:
    return {
        "model": {"init_from": str(hf)},
        "data": {"train": str(packed), "format": "chat", "seq_length": 128},
        "parallel": parallel,
        **({"finetune": {"method": "lora", "lora": {"r": 4, "alpha": 8.0, "target_modules": TARGETS}}} if lora else {}),
        "train": {
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": STEPS,
            "lr": 1e-2 if lora else 1e-3,
            "warmup_steps": 0,
            "log_interval": 1,
            "eval_interval": 0,
            "seed": 3,
            "progress": False,
            "output_dir": str(out),
        },
    }


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_tp")
    hf = hf_moe(
        root / "hf", 0, "qwen2_moe", shared_expert_intermediate_size=48, router_aux_loss_coef=0.01,
        max_position_embeddings=256,
    )  # fmt: skip
    (hf / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    packed = pack_chat(root, hf)
    out = {}
    for name, parallel, lora in (
        ("full", {}, False),
        ("full-tp2", TP, False),
        ("lora", {}, True),
        ("lora-tp2", TP, True),
    ):
        out[name] = root / name
        r = fitlm("train", write_config(root / f"{name}.yaml", _config(hf, packed, out[name], parallel, lora)))
        assert r.returncode == 0, r.stderr[-3000:]
    return out


def _steps(run: Path) -> list[dict]:
    return [m for m in read_metrics(run) if "loss" in m and "step" in m]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_tensor_parallel_equals_one_process(runs, kind):
    one, tp = _steps(runs[kind]), _steps(runs[f"{kind}-tp2"])
    assert len(one) == STEPS and one[-1]["loss"] < one[0]["loss"]
    for key in ("loss", "grad_norm", "aux_loss"):
        assert [m[key] for m in tp] == pytest.approx([m[key] for m in one], rel=1e-4), key
    name = "model/model.safetensors" if kind == "full" else "adapter/adapter_model.safetensors"
    want, got = load_file(str(runs[kind] / name)), load_file(str(runs[f"{kind}-tp2"] / name))
    assert sorted(got) == sorted(want)
    if kind == "lora":  # adapters on the experts and on the shared expert, under transformers' names
        assert any(".mlp.experts." in k for k in want) and any(".shared_expert." in k for k in want)
    for k, v in want.items():  # the layout tests' bound (tests/distributed/test_layouts.assert_same_training)
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
