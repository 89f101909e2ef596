"""Every parallel layout trains the same model: `fitlm train` launches torchrun itself (gloo, CPU), and
the losses and final weights equal the single-process run on the same data, seed and global batch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

STEPS = 4
# Single process: micro batch 4 × accumulation 2 = 8 sequences per step.
REFERENCE = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}


def run(tiny_corpus, root, name, parallel: dict, train: dict, *extra: str, memory: dict | None = None,
        model: dict | None = None, data: dict | None = None):
    train = {"max_steps": STEPS, "eval_interval": STEPS, **train}
    cfg = tiny_config(tiny_corpus, root / name, train=train, parallel=parallel,
                      model={"tie_embeddings": False, **(model or {})}, memory=memory or {}, data=data or {})
    proc = fitlm("train", write_config(root / f"{name}.yaml", cfg), "--json", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    losses = [r["loss"] for r in read_metrics(root / name) if "loss" in r]
    weights = load_file(str(root / name / "model" / "model.safetensors"))
    return {"losses": losses, "weights": weights, "eval_loss": summary["eval_loss"],
            "grad_norms": [r["grad_norm"] for r in read_metrics(root / name) if "loss" in r]}


TIES = [pytest.param(True, id="tied"), pytest.param(False, id="untied")]  # tied first: the shipped configs' default
DEEP = {"num_layers": 4}  # interleaved_1f1b over pp2 makes 4 stages, one block each


@pytest.fixture(scope="module")
def reference(single_process_reference, tiny_corpus, tmp_path_factory):
    """The single-process run for (tied, model overrides): the session's shared one for the plain model."""
    deep: dict[bool, dict] = {}

    def get(tied: bool, model: dict | None = None) -> dict:
        if not model:
            return single_process_reference(True, tied)  # data.document_mask's default
        if tied not in deep:
            deep[tied] = run(tiny_corpus, tmp_path_factory.mktemp(f"ref-deep-tied{int(tied)}"), "single", {},
                             REFERENCE, model={**model, "tie_embeddings": tied})
        return deep[tied]

    return get


def assert_same_training(result, reference):
    assert result["losses"] == pytest.approx(reference["losses"], rel=2e-5, abs=1e-5)
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4, abs=1e-5)
    assert result["eval_loss"] == pytest.approx(reference["eval_loss"], rel=2e-5)
    assert result["weights"].keys() == reference["weights"].keys()
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], tensor, rtol=1e-4, atol=1e-4, msg=name)  # Adam amplifies fp32 reduction-order noise


# (name, parallel block, train block[, model overrides]): the global batch stays 8 sequences per step in every layout.
DP_LAYOUTS = [
    ("dp2-zero0-ddp", {"data_parallel": 2, "zero_stage": 0}, {"micro_batch_size": 2, "gradient_accumulation_steps": 2}),
    ("dp2-zero1", {"data_parallel": 2, "zero_stage": 1}, {"micro_batch_size": 2, "gradient_accumulation_steps": 2}),
    ("dp2-zero2", {"data_parallel": 2, "zero_stage": 2}, {"micro_batch_size": 4, "gradient_accumulation_steps": 1}),
    ("dp2-zero3", {"data_parallel": 2, "zero_stage": 3}, {"micro_batch_size": 2, "gradient_accumulation_steps": 2}),
]


REPLICA = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}  # one replica: the reference's batch
HALF = {"micro_batch_size": 2, "gradient_accumulation_steps": 2}  # two replicas
SLOW = pytest.mark.slow  # `make test-quick` leaves these out; CI (`make test`) runs them
MODEL_LAYOUTS = [
    pytest.param("pp2-1f1b", {"pipeline_parallel": 2, "micro_batch_num": 2}, REPLICA, None, id="pp2-1f1b"),
    pytest.param("pp2-gpipe-m4", {"pipeline_parallel": 2, "pipeline_schedule": "gpipe", "micro_batch_num": 4}, REPLICA,
                 None, marks=SLOW, id="pp2-gpipe-m4"),
    pytest.param("pp2-interleaved", {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b",
                                     "micro_batch_num": 2}, REPLICA, DEEP, marks=SLOW, id="pp2-interleaved"),
    pytest.param("tp2", {"tensor_parallel": 2}, REPLICA, None, id="tp2"),
    pytest.param("tp2-sp", {"tensor_parallel": 2, "sequence_parallel": True}, REPLICA, None, marks=SLOW, id="tp2-sp"),
    pytest.param("dp2-tp2", {"data_parallel": 2, "tensor_parallel": 2}, HALF, None, marks=SLOW, id="dp2-tp2"),
    pytest.param("dp2-zero3-tp2", {"data_parallel": 2, "zero_stage": 3, "tensor_parallel": 2}, HALF, None,
                 id="dp2-zero3-tp2"),
    pytest.param("tp2-pp2", {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 2}, REPLICA, None,
                 id="tp2-pp2"),
    pytest.param("tp2-sp-pp2-interleaved", {"tensor_parallel": 2, "sequence_parallel": True, "pipeline_parallel": 2,
                                            "pipeline_schedule": "interleaved_1f1b", "micro_batch_num": 2}, REPLICA,
                 DEEP, marks=SLOW, id="tp2-sp-pp2-interleaved"),
    pytest.param("dp2-zero2-pp2", {"data_parallel": 2, "zero_stage": 2, "pipeline_parallel": 2, "micro_batch_num": 2},
                 HALF, None, id="dp2-zero2-pp2"),
    pytest.param("dp2-zero3-pp2", {"data_parallel": 2, "zero_stage": 3, "pipeline_parallel": 2, "micro_batch_num": 2},
                 HALF, None, marks=SLOW, id="dp2-zero3-pp2"),
    pytest.param("dp2-tp2-pp2", {"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2,
                                 "micro_batch_num": 2}, HALF, None, marks=SLOW, id="dp2-tp2-pp2"),
]


@pytest.mark.parametrize("tied", TIES)
@pytest.mark.parametrize("name,parallel,train,model", MODEL_LAYOUTS)
def test_model_parallel_and_hybrid_layouts_equal_single_process(tiny_corpus, tmp_path, reference, name, parallel,
                                                                 train, model, tied):
    result = run(tiny_corpus, tmp_path, name, parallel, train, model={**(model or {}), "tie_embeddings": tied})
    assert_same_training(result, reference(tied, model))


@pytest.mark.parametrize("tied", TIES)
@pytest.mark.parametrize("name,parallel,train", DP_LAYOUTS, ids=[x[0] for x in DP_LAYOUTS])
def test_data_parallel_layouts_equal_single_process(tiny_corpus, tmp_path, reference, name, parallel, train, tied):
    assert_same_training(run(tiny_corpus, tmp_path, name, parallel, train, model={"tie_embeddings": tied}),
                         reference(tied))


def test_two_node_rendezvous_on_localhost(tiny_corpus, tmp_path, reference):
    """Two torchrun "nodes" (one process each) meet through a c10d rendezvous, as on a real cluster."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    train = {"max_steps": STEPS, "eval_interval": STEPS, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    cfg = tiny_config(tiny_corpus, tmp_path / "nodes", train=train, parallel={"data_parallel": 2},
                      model={"tie_embeddings": False})
    path = write_config(tmp_path / "nodes.yaml", cfg)
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fitlm-test",
         "-m", "fitlm.cli", "train", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    losses = [r["loss"] for r in read_metrics(tmp_path / "nodes") if "loss" in r]
    assert losses == pytest.approx(reference(False)["losses"], rel=2e-5, abs=1e-5)


@pytest.mark.parametrize("kind", ["matmul", "matmul_saved"])
def test_matmul_attention_under_tensor_parallel_equals_single_process(tiny_corpus, tmp_path, reference, kind):
    """memory.attention_backward: matmul / matmul_saved on each tensor-parallel rank's heads (document masks on, GQA)
    trains as the single process does with SDPA: the kernels differ by fp32 rounding only."""
    result = run(tiny_corpus, tmp_path, f"tp2-{kind}-attn", {"tensor_parallel": 2}, REPLICA,
                 memory={"attention_backward": kind})
    assert_same_training(result, reference(False))
