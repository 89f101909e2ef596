"""Every parallel layout trains the same model: `fitlm train` launches torchrun itself (gloo, CPU), and
the losses and final weights equal the single-process run on the same data, seed and global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fitlm.config import ParallelConfig
from tests.conftest import ROOT
from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

STEPS = 4
# Single process: micro batch 4 × accumulation 2 = 8 sequences per step.
REFERENCE = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}


def layout_config(
    tiny_corpus,
    root,
    name,
    parallel: dict,
    train: dict,
    memory: dict | None = None,
    model: dict | None = None,
    data: dict | None = None,
    finetune: dict | None = None,
) -> dict:
    """The layout tests' config: the golden tiny run for STEPS steps, one eval at the end.

    AdamW's eps is 1e-6, not 1e-8: an element whose gradient cancels to ~1e-10 is all fp32 reduction-order noise,
    and with eps 1e-8 Adam turns that noise into an update of ~1e-2 lr (seen: one element of a rarely seen
    embedding row 5e-4 apart after 4 steps under tp2-sp x pp2 interleaved, and under Gemma 2 ZeRO-3). Losses and
    gradient norms are equal either way; the larger eps keeps the weight comparison about the layout."""
    train = {"max_steps": STEPS, "eval_interval": STEPS, "eps": 1e-6, **train}
    return tiny_config(
        tiny_corpus,
        root / name,
        train=train,
        parallel=parallel,
        model={"tie_embeddings": False, **(model or {})},
        memory=memory or {},
        data=data or {},
        **({"finetune": finetune} if finetune else {}),
    )


def collect(out_dir, eval_loss: float) -> dict:
    """What a layout test compares: per-step losses and gradient norms, the final eval loss and weights."""
    metrics = [r for r in read_metrics(out_dir) if "loss" in r]
    return {
        "losses": [r["loss"] for r in metrics],
        "grad_norms": [r["grad_norm"] for r in metrics],
        "balance": [r[k] for r in metrics if "aux_loss" in r for k in ("aux_loss", "expert_load")],  # MoE: routing
        "bias": [r["router_bias_max"] for r in metrics if "router_bias_max" in r],  # MoE aux_free: the largest |b_e|
        "eval_loss": eval_loss,
        "weights": load_file(str(out_dir / "model" / "model.safetensors")),
    }


def run(
    tiny_corpus,
    root,
    name,
    parallel: dict,
    train: dict,
    *extra: str,
    memory: dict | None = None,
    model: dict | None = None,
    data: dict | None = None,
):
    """One `fitlm train` through the CLI (which starts torchrun itself for a parallel layout)."""
    cfg = layout_config(tiny_corpus, root, name, parallel, train, memory, model, data)
    proc = fitlm("train", write_config(root / f"{name}.yaml", cfg), "--json", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return collect(root / name, json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"])


def run_shared(
    tiny_corpus, root, cases: dict[str, dict], timeout: int = 900, keep_going: bool = False
) -> dict[str, dict]:
    """Many layouts as `run` trains each, with one torchrun world per world size for all of them
    (tests/distributed/train_world.py): `cases` maps a name to layout_config's keyword arguments.
    `keep_going`: a refused case gives {"error": its message} and the world goes on to the next."""
    by_world: dict[int, list[str]] = {}
    for name, kw in cases.items():
        write_config(root / f"{name}.yaml", layout_config(tiny_corpus, root, name, **kw))
        by_world.setdefault(ParallelConfig(**kw["parallel"]).world_size, []).append(name)
    for world, names in by_world.items():
        (root / f"world{world}.json").write_text(json.dumps([str(root / f"{n}.yaml") for n in names]))
        # as fitlm.parallel.launch: the cores shared between the ranks
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fitlm.parallel.lifetime",
                "--standalone",
                f"--nproc-per-node={world}",
                "-m",
                "tests.distributed.train_world",
                str(root / f"world{world}.json"),
                *(["--keep-going"] if keep_going else []),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"world of {world} ({', '.join(names)}):\n" + proc.stderr[-6000:]
    refused = {n: (root / f"{n}.error.txt").read_text() for n in cases if (root / f"{n}.error.txt").exists()}
    return {
        n: {"error": refused[n]}
        if n in refused
        else collect(root / n, json.loads((root / f"{n}.summary.json").read_text())["eval_loss"])
        for n in cases
    }


def selected(request, test: str) -> list[dict]:
    """The parameters of `test`'s items in this module that this session runs (selected, not skipped)."""
    return [
        item.callspec.params
        for item in request.session.items
        if item.module is request.module and item.originalname == test and not item.get_closest_marker("skip")
    ]


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
            deep[tied] = run(
                tiny_corpus,
                tmp_path_factory.mktemp(f"ref-deep-tied{int(tied)}"),
                "single",
                {},
                REFERENCE,
                model={**model, "tie_embeddings": tied},
            )
        return deep[tied]

    return get


def assert_same_training(result, reference):
    assert result["losses"] == pytest.approx(reference["losses"], rel=2e-5, abs=1e-5)
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4, abs=1e-5)
    assert result["eval_loss"] == pytest.approx(reference["eval_loss"], rel=2e-5)
    assert result["weights"].keys() == reference["weights"].keys()
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(
            result["weights"][name], tensor, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


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
    pytest.param(
        "pp2-gpipe-m4",
        {"pipeline_parallel": 2, "pipeline_schedule": "gpipe", "micro_batch_num": 4},
        REPLICA,
        None,
        marks=SLOW,
        id="pp2-gpipe-m4",
    ),
    pytest.param(
        "pp2-interleaved",
        {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b", "micro_batch_num": 2},
        REPLICA,
        DEEP,
        marks=SLOW,
        id="pp2-interleaved",
    ),
    pytest.param("tp2", {"tensor_parallel": 2}, REPLICA, None, id="tp2"),
    pytest.param("tp2-sp", {"tensor_parallel": 2, "sequence_parallel": True}, REPLICA, None, marks=SLOW, id="tp2-sp"),
    pytest.param("dp2-tp2", {"data_parallel": 2, "tensor_parallel": 2}, HALF, None, marks=SLOW, id="dp2-tp2"),
    pytest.param(
        "dp2-zero3-tp2", {"data_parallel": 2, "zero_stage": 3, "tensor_parallel": 2}, HALF, None, id="dp2-zero3-tp2"
    ),
    pytest.param(
        "tp2-pp2", {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 2}, REPLICA, None, id="tp2-pp2"
    ),
    pytest.param(
        "tp2-sp-pp2-interleaved",
        {
            "tensor_parallel": 2,
            "sequence_parallel": True,
            "pipeline_parallel": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "micro_batch_num": 2,
        },
        REPLICA,
        DEEP,
        marks=SLOW,
        id="tp2-sp-pp2-interleaved",
    ),
    pytest.param(
        "dp2-zero2-pp2",
        {"data_parallel": 2, "zero_stage": 2, "pipeline_parallel": 2, "micro_batch_num": 2},
        HALF,
        None,
        id="dp2-zero2-pp2",
    ),
    pytest.param(
        "dp2-zero3-pp2",
        {"data_parallel": 2, "zero_stage": 3, "pipeline_parallel": 2, "micro_batch_num": 2},
        HALF,
        None,
        marks=SLOW,
        id="dp2-zero3-pp2",
    ),
    pytest.param(
        "dp2-tp2-pp2",
        {"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 2},
        HALF,
        None,
        marks=SLOW,
        id="dp2-tp2-pp2",
    ),
]


LAYOUTS = {p.values[0]: p.values[1:] for p in MODEL_LAYOUTS} | {n: (par, tr, None) for n, par, tr in DP_LAYOUTS}


@pytest.fixture(scope="module")
def layout_runs(request, tiny_corpus, tmp_path_factory) -> dict[tuple[str, bool], dict]:
    """Every layout case this session runs in this module, trained in shared worlds (run_shared), once."""
    cases = {}
    for test in (
        "test_model_parallel_and_hybrid_layouts_equal_single_process",
        "test_data_parallel_layouts_equal_single_process",
    ):
        for params in selected(request, test):
            parallel, train, model = LAYOUTS[params["name"]]
            cases[f"{params['name']}-{'tied' if params['tied'] else 'untied'}"] = {
                "parallel": parallel,
                "train": train,
                "model": {**(model or {}), "tie_embeddings": params["tied"]},
            }
    runs = run_shared(tiny_corpus, tmp_path_factory.mktemp("layouts"), cases) if cases else {}
    return {(name.rsplit("-", 1)[0], name.endswith("-tied")): result for name, result in runs.items()}


@pytest.mark.parametrize("tied", TIES)
@pytest.mark.parametrize("name,parallel,train,model", MODEL_LAYOUTS)
def test_model_parallel_and_hybrid_layouts_equal_single_process(
    layout_runs, reference, name, parallel, train, model, tied
):
    assert_same_training(layout_runs[name, tied], reference(tied, model))


@pytest.mark.parametrize("tied", TIES)
@pytest.mark.parametrize("name,parallel,train", DP_LAYOUTS, ids=[x[0] for x in DP_LAYOUTS])
def test_data_parallel_layouts_equal_single_process(layout_runs, reference, name, parallel, train, tied):
    assert_same_training(layout_runs[name, tied], reference(tied))


# -- the same matrix on an MoE model --------------------------------------------------------------------------
# Qwen3-MoE (4 experts, 2 a token) with a dense block among the sparse ones (test_family_layouts.FAMILIES), aux loss
# off there (a mean per micro batch, whose rows a data split changes; test_expert_parallel.py holds the layouts
# with it on). Every layout above, and expert parallel beside each parallelism it composes with.
MOE_LAYOUTS = {  # name: (parallel, train, model overrides)
    "dp2-ep2": ({"data_parallel": 2, "expert_parallel": 2}, HALF, None),
    "dp2-ep2-zero1": ({"data_parallel": 2, "expert_parallel": 2, "zero_stage": 1}, HALF, None),
    "dp2-ep2-zero3": ({"data_parallel": 2, "expert_parallel": 2, "zero_stage": 3}, HALF, None),
    "dp2-ep2-tp2-sp": (
        {"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True},
        HALF,
        None,
    ),
    "dp2-ep2-zero3-tp2": (
        {"data_parallel": 2, "expert_parallel": 2, "zero_stage": 3, "tensor_parallel": 2},
        HALF,
        None,
    ),
    "dp2-ep2-zero2-cp2": (  # (ZeRO 0 beside cp: test_expert_parallel.py, aux loss on)
        {"data_parallel": 2, "expert_parallel": 2, "zero_stage": 2, "context_parallel": 2},
        HALF,
        None,
    ),
    "dp2-ep2-pp2": (
        {"data_parallel": 2, "expert_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 2},
        HALF,
        None,
    ),
}
MOE_CASES = {**LAYOUTS, **MOE_LAYOUTS}


@pytest.fixture(scope="module")
def moe_runs(request, tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    """The selected MoE layouts and their single-process references (plain and deep), in shared worlds."""
    from tests.distributed.test_family_layouts import FAMILIES

    cases = {}
    for params in selected(request, "test_moe_layouts_equal_single_process"):
        parallel, train, extra = MOE_CASES[params["name"]]
        tie = "tied" if params["tied"] else "untied"
        model = {**FAMILIES["qwen3_moe"], **(extra or {}), "tie_embeddings": params["tied"]}
        cases[f"single-{tie}" + ("-deep" if extra else "")] = {"parallel": {}, "train": REFERENCE, "model": model}
        cases[f"{params['name']}-{tie}"] = {"parallel": parallel, "train": train, "model": model}
    return run_shared(tiny_corpus, tmp_path_factory.mktemp("moe-layouts"), cases) if cases else {}


@pytest.mark.slow
@pytest.mark.parametrize("tied", TIES)
@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_layouts_equal_single_process(moe_runs, name, tied):
    tie = "tied" if tied else "untied"
    reference = moe_runs[f"single-{tie}" + ("-deep" if MOE_CASES[name][2] else "")]
    assert_same_training(moe_runs[f"{name}-{tie}"], reference)
    assert moe_runs[f"{name}-{tie}"]["balance"][1::2] == pytest.approx(reference["balance"][1::2], rel=1e-4)  # load


def test_two_node_rendezvous_on_localhost(tiny_corpus, tmp_path, reference):
    """Two torchrun "nodes" (one process each) meet through a c10d rendezvous, as on a real cluster."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = layout_config(tiny_corpus, tmp_path, "nodes", {"data_parallel": 2}, HALF)
    path = write_config(tmp_path / "nodes.yaml", cfg)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={rank}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=fitlm-test",
                "-m",
                "fitlm.cli",
                "train",
                str(path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    losses = [r["loss"] for r in read_metrics(tmp_path / "nodes") if "loss" in r]
    assert losses == pytest.approx(reference(False)["losses"], rel=2e-5, abs=1e-5)


@pytest.mark.parametrize("kind", ["matmul", "matmul_saved"])
def test_matmul_attention_under_tensor_parallel_equals_single_process(tiny_corpus, tmp_path, reference, kind):
    """memory.attention_backward: matmul / matmul_saved on each tensor-parallel rank's heads (document masks on, GQA)
    trains as the single process does with SDPA: the kernels differ by fp32 rounding only."""
    result = run(
        tiny_corpus, tmp_path, f"tp2-{kind}-attn", {"tensor_parallel": 2}, REPLICA, memory={"attention_backward": kind}
    )
    assert_same_training(result, reference(False))
