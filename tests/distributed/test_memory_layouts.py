"""Memory options under parallel layouts (real `fitlm train`, torchrun, gloo): each layout with an option
trains like the single process with the same option. Half precision rounds differently when the work is
split, so the match is close rather than exact."""

from __future__ import annotations

import pytest

from tests.distributed.test_layouts import HALF, REFERENCE, REPLICA, run_shared, selected

# (name, parallel, train batch for that layout, memory options)
CASES = [
    # FSDP2 MixedPrecisionPolicy (half gather, fp32 reduce) + fp16 scaler over ranks + chunked loss + offload
    # (slow tier: 40 s, fp16 has no fast CPU GEMM)
    pytest.param(
        "dp2-zero3-o2-fp16-chunked-offload",
        {"data_parallel": 2, "zero_stage": 3},
        HALF,
        {"mixed_precision": "O2", "half_dtype": "fp16", "loss_chunk_size": 48, "cpu_offload": True},
        marks=pytest.mark.slow,
    ),
    # parameter casting on DTensor shards + selective recompute (slow tier: make test-all)
    pytest.param(
        "tp2-o2-bf16-selective",
        {"tensor_parallel": 2},
        REPLICA,
        {"mixed_precision": "O2", "recompute": "selective"},
        marks=pytest.mark.slow,
    ),
    # fp16 loss scale through the pipeline schedule + full recompute of every second block (slow tier)
    pytest.param(
        "pp2-o2-fp16-recompute",
        {"pipeline_parallel": 2, "micro_batch_num": 2},
        REPLICA,
        {"mixed_precision": "O2", "half_dtype": "fp16", "recompute": "full", "recompute_every_n_layers": 2},
        marks=pytest.mark.slow,
    ),
]


IDS = ["dp2-zero3-o2-fp16-chunked-offload", "tp2-o2-bf16-selective", "pp2-o2-fp16-recompute"]


@pytest.fixture(scope="module")
def memory_runs(request, tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    """Each selected case and its single-process run with the same options, in shared worlds (run_shared)."""
    cases = {}
    for params in selected(request, "test_memory_options_under_layouts_match_single_process"):
        name, memory = params["name"], params["memory"]
        cases[f"single-{name}"] = {"parallel": {}, "train": REFERENCE, "memory": memory}
        cases[name] = {"parallel": params["parallel"], "train": params["train"], "memory": memory}
    return run_shared(tiny_corpus, tmp_path_factory.mktemp("memory"), cases) if cases else {}


@pytest.mark.parametrize("name,parallel,train,memory", CASES, ids=IDS)
def test_memory_options_under_layouts_match_single_process(
    memory_runs, single_process_reference, name, parallel, train, memory
):
    single, split = memory_runs[f"single-{name}"], memory_runs[name]
    assert split["losses"] == pytest.approx(single["losses"], rel=5e-4)
    assert split["grad_norms"] == pytest.approx(single["grad_norms"], rel=5e-3)
    assert split["eval_loss"] == pytest.approx(single["eval_loss"], rel=5e-4)
    # and the option changed the arithmetic (a silently ignored option would give the fp32 numbers exactly)
    fp32 = single_process_reference(True) if name.startswith("dp2") else None  # the layout tests' fp32 run
    if fp32:
        assert split["losses"] != fp32["losses"]
