"""Each family trains the same under data parallel ZeRO-3 and pipeline parallel (MoE: pipeline parallel with the
auxiliary loss on, MOE_PIPELINE) as in one process:
`fitlm train` (torchrun, gloo), same data, seed and global batch; losses, gradient norms and final
weights equal. Tensor parallel of every family is checked module by module in test_tensor_parallel.py.
Qwen3 and Gemma 3 (the two most unlike Llama) run in the fast tier, the others in the slow one.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_layouts import assert_same_training, run_shared, selected

FAMILIES = {  # model section overrides of the tiny config (hidden 64, 2 layers, 4 heads, 2 kv heads)
    "qwen3": {"arch": "qwen3", "head_dim": 24},
    "gemma3": {
        "arch": "gemma3",
        "head_dim": 24,
        "sliding_window": 16,
        "rope_theta": 1e6,
        "rope_local_theta": 1e4,
        "layer_types": ["sliding", "full"],
    },
    "qwen2": {"arch": "qwen2"},
    "gemma2": {
        "arch": "gemma2",
        "head_dim": 24,
        "sliding_window": 16,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcap": 50.0,
        "final_logit_softcap": 30.0,
    },
    "phi3": {"arch": "phi3", "sliding_window": 24},
    # An MoE with a dense block. Its load-balancing loss is off here: transformers' aux loss is a mean per
    # micro batch (a product of two means, not a sum over tokens), so it equals one process's only where the
    # ranks' micro batches hold the same rows as the one process's, which the data split does not give.
    "qwen3_moe": {
        "arch": "qwen3_moe",
        "head_dim": 24,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "mlp_only_layers": [1],
        "router_aux_loss_coef": 0.0,
    },
    # a shared expert (its gate [1, H]: fewer rows than ranks under ZeRO-3) and every other block dense
    "qwen2_moe": {
        "arch": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 2,
        "router_aux_loss_coef": 0.0,
    },
}
PIPELINED = [
    f for f in FAMILIES if "num_experts" not in FAMILIES[f]
]  # the MoE families' pipeline runs are MOE_PIPELINE's
# MoE under pipeline parallel with the aux loss on (fitlm/step/pipeline_balance.py): 4 blocks, so stage 0 holds a
# sparse and the dense block and stage 1 two sparse ones, and the loss couples the stages' routing. The pipeline
# layouts' micro batches hold the one process's rows (no data parallel), so the per-micro-batch aux loss agrees.
MOE_PP = {**FAMILIES["qwen3_moe"], "num_layers": 4, "router_aux_loss_coef": 0.1}
QWEN2_MOE_PP = {**FAMILIES["qwen2_moe"], "num_layers": 4, "router_aux_loss_coef": 0.001}
MIXTRAL_PP = {"arch": "mixtral", "head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2, "num_layers": 4}
MOE_MEMORY = {"qwen2_moe-pp2-recompute": {"recompute": "full"}}  # the pipeline run's memory section
MOE_PIPELINE = {  # case: (model, parallel)
    "qwen3_moe-pp2-1f1b": (MOE_PP, {"pipeline_parallel": 2, "micro_batch_num": 2}),
    "qwen3_moe-pp2-gpipe-m4-tied": (
        {**MOE_PP, "tie_embeddings": True},
        {"pipeline_parallel": 2, "pipeline_schedule": "gpipe", "micro_batch_num": 4},
    ),
    "qwen3_moe-pp2-interleaved": (
        MOE_PP,
        {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b", "micro_batch_num": 2},
    ),
    "mixtral-pp2-1f1b": ({**MIXTRAL_PP, "router_aux_loss_coef": 0.1}, {"pipeline_parallel": 2, "micro_batch_num": 2}),
    # aux-loss-free balancing: every stage's layers' biases follow their loads (a step large enough to reroute)
    "qwen3_moe-pp2-aux-free": (
        {**MOE_PP, "moe_balance": "aux_free", "router_bias_update_rate": 0.05},
        {"pipeline_parallel": 2, "micro_batch_num": 2},
    ),
    # a shared expert and a dense block every other layer, every block recomputed (its router forward rerun)
    "qwen2_moe-pp2-recompute": (
        {**QWEN2_MOE_PP, "router_aux_loss_coef": 0.1},
        {"pipeline_parallel": 2, "micro_batch_num": 2},
    ),
    # A capacity is per forward: with one chunk per micro batch a chunk's tokens are the one process's forward's.
    "qwen3_moe-pp2-capacity-m1": ({**MOE_PP, "capacity_factor": 1.0}, {"pipeline_parallel": 2, "micro_batch_num": 1}),
    # ZeRO-2 on each stage's dp2 replicas, and expert parallel inside each stage (each stage's experts split over
    # its ep2 group, the all-to-alls among the ranks of one stage); the aux loss off, as the data split gives the
    # micro batches other rows than the one process's
    "qwen3_moe-dp2-zero2-pp2": (
        {**MOE_PP, "router_aux_loss_coef": 0.0},
        {"pipeline_parallel": 2, "micro_batch_num": 2, "data_parallel": 2, "zero_stage": 2},
    ),
    "qwen3_moe-dp2-ep2-pp2": (
        {**MOE_PP, "router_aux_loss_coef": 0.0},
        {"pipeline_parallel": 2, "micro_batch_num": 2, "data_parallel": 2, "expert_parallel": 2},
    ),
    # the aux loss on under data parallel: one row a micro batch, so each rank's micro batches hold the one process's
    # rows (MOE_PIPELINE_BATCH); the loss couples the stages' routing and the all-to-alls run inside each stage
    "qwen3_moe-dp2-ep2-pp2-aux": (
        MOE_PP,
        {"pipeline_parallel": 2, "micro_batch_num": 1, "data_parallel": 2, "expert_parallel": 2},
    ),
    # tensor parallel inside each stage: attention split, the routed blocks whole on each tp rank
    "qwen3_moe-tp2-pp2": (MOE_PP, {"pipeline_parallel": 2, "micro_batch_num": 2, "tensor_parallel": 2}),
    "mixtral-dp2-ep2-zero3-pp2-tied": (
        {**MIXTRAL_PP, "tie_embeddings": True, "router_aux_loss_coef": 0.0},
        {"pipeline_parallel": 2, "micro_batch_num": 2, "data_parallel": 2, "expert_parallel": 2, "zero_stage": 3},
    ),
}
# case: (its per-rank batch, the one process's): one row a micro batch (the loader deals rank r rows r, r + dp, ...)
MOE_PIPELINE_BATCH = {
    "qwen3_moe-dp2-ep2-pp2-aux": (
        {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
        {"micro_batch_size": 1, "gradient_accumulation_steps": 8},
    )
}
MOE_PIPELINE_FAST = ("qwen3_moe-pp2-1f1b", "qwen3_moe-pp2-aux-free")
FAST = ("qwen3", "gemma3")
LAYOUTS = {
    "dp2-zero3": ({"data_parallel": 2, "zero_stage": 3}, {"micro_batch_size": 2, "gradient_accumulation_steps": 2}),
    "pp2": ({"pipeline_parallel": 2, "micro_batch_num": 2}, {"micro_batch_size": 4, "gradient_accumulation_steps": 2}),
}


REFERENCE_BATCH = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}
CASES = [
    pytest.param(
        f,
        lay,
        id=f"{f}-{lay}",
        marks=() if f in FAST and lay == "dp2-zero3" or (f == "gemma3" and lay == "pp2") else pytest.mark.slow,
    )
    for f in FAMILIES
    for lay in LAYOUTS
    if lay != "pp2" or f in PIPELINED
]


@pytest.fixture(scope="module")
def family_runs(request, tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    """Each selected (family, layout) and each family's single-process run, in shared worlds (run_shared)."""
    cases = {}
    for params in selected(request, "test_moe_pipeline_equals_single_process"):
        model, parallel = MOE_PIPELINE[params["case"]]
        train = {"micro_batch_size": 2, "gradient_accumulation_steps": 2} if "data_parallel" in parallel else None
        train, single = MOE_PIPELINE_BATCH.get(params["case"], (train or REFERENCE_BATCH, REFERENCE_BATCH))
        cases[params["case"]] = {"parallel": parallel, "train": train, "model": model}
        if params["case"] in MOE_MEMORY:
            cases[params["case"]]["memory"] = MOE_MEMORY[params["case"]]
        cases[params["case"] + "-single"] = {"parallel": {}, "train": single, "model": model}
    for params in selected(request, "test_family_layout_equals_single_process"):
        family, layout = params["family"], params["layout"]
        parallel, train = LAYOUTS[layout]
        cases[f"{family}-single"] = {"parallel": {}, "train": REFERENCE_BATCH, "model": FAMILIES[family]}
        cases[f"{family}-{layout}"] = {"parallel": parallel, "train": train, "model": FAMILIES[family]}
    return run_shared(tiny_corpus, tmp_path_factory.mktemp("families"), cases) if cases else {}


@pytest.mark.parametrize("family,layout", CASES)
def test_family_layout_equals_single_process(family_runs, family, layout):
    reference = family_runs[f"{family}-single"]
    assert reference["losses"][-1] < reference["losses"][0]  # it trained
    assert_same_training(family_runs[f"{family}-{layout}"], reference)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in MOE_PIPELINE_FAST else pytest.mark.slow) for c in MOE_PIPELINE]
)
def test_moe_pipeline_equals_single_process(family_runs, case):
    """Pipeline parallel on an MoE model with the aux loss on: losses, gradient norms and weights of one process."""
    reference = family_runs[f"{case}-single"]
    assert reference["losses"][-1] < reference["losses"][0]  # it trained
    assert_same_training(family_runs[case], reference)
    # the logged aux loss and expert load: every stage's MoE layers, as one process logs them (under data parallel
    # the load only: the aux loss is a mean per micro batch, whose rows the data split changes)
    step = 2 if "data_parallel" in MOE_PIPELINE[case][1] and case not in MOE_PIPELINE_BATCH else 1
    assert family_runs[case]["balance"][step - 1 :: step] == pytest.approx(
        reference["balance"][step - 1 :: step], rel=2e-5, abs=1e-5
    )
    assert len(reference["balance"]) == 2 * len(reference["losses"])
    assert family_runs[case]["bias"] == pytest.approx(reference["bias"], rel=2e-5, abs=1e-7)
    assert bool(reference["bias"]) == (MOE_PIPELINE[case][0].get("moe_balance") == "aux_free")


def test_phi3_checkpoint_reshards_between_layouts(tiny_corpus, tmp_path):
    """Phi-3 splits its fused projections for sharding in every layout but LoRA, so a single-process
    checkpoint resumes under tensor parallel (and the final model/ has HF's fused names again)."""
    import json

    from safetensors.torch import load_file

    from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

    def train(name, parallel, checkpoint):
        cfg = tiny_config(
            tiny_corpus,
            tmp_path / name,
            model={**FAMILIES["phi3"], "tie_embeddings": False},
            parallel=parallel,
            checkpoint=checkpoint,
            train={"max_steps": 4, "eval_interval": 0, "micro_batch_size": 4, "gradient_accumulation_steps": 2},
        )
        proc = fitlm("train", write_config(tmp_path / f"{name}.yaml", cfg), "--json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r}

    ref = train("single", {}, {"interval": 2})
    resumed = train(
        "tp2", {"tensor_parallel": 2}, {"resume": str(tmp_path / "single" / "checkpoints" / "step_00000002")}
    )
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == pytest.approx([ref[s] for s in (3, 4)], rel=2e-5, abs=1e-5)
    weights = load_file(str(tmp_path / "tp2" / "model" / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights and "model.layers.0.mlp.gate_up_proj.weight" in weights
    single = load_file(str(tmp_path / "single" / "model" / "model.safetensors"))
    for k, v in single.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-4, msg=k)
    assert json.loads((tmp_path / "tp2" / "model" / "fitlm.json").read_text())


AUX_FREE_WRITERS = {  # layout a checkpoint is written under: (parallel, per-rank batch of the same global batch)
    "pp2": ({"pipeline_parallel": 2, "micro_batch_num": 2}, REFERENCE_BATCH),
    # 4 ranks: each stage's experts split over its ep2 group, its biases moved by the loads of both data ranks
    "dp2-ep2-pp2": (
        {"pipeline_parallel": 2, "micro_batch_num": 2, "data_parallel": 2, "expert_parallel": 2},
        {"micro_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(AUX_FREE_WRITERS))
def test_moe_aux_free_pipeline_checkpoint_resumes_in_one_process(tiny_corpus, tmp_path, writer):
    """Every stage's routing biases are in a checkpoint written under pp2 or dp2 × ep2 × pp2 (rank 0 writes them,
    holding stage 0's layers only; under ep the experts are DTensors split over the ep ranks): one process (ep1)
    resumes from it with the biases and the experts whole, and continues as the uninterrupted run; the dp2 × ep2 ×
    pp2 one resumes under tp2 too."""
    from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

    model, _ = MOE_PIPELINE["qwen3_moe-pp2-aux-free"]

    def train(name, parallel, checkpoint, batch=REFERENCE_BATCH):
        cfg = tiny_config(
            tiny_corpus,
            tmp_path / name,
            model={**model, "tie_embeddings": False},
            parallel=parallel,
            checkpoint=checkpoint,
            train={"max_steps": 4, "eval_interval": 0, **batch},
        )
        proc = fitlm("train", write_config(tmp_path / f"{name}.yaml", cfg), "--json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        return {r["step"]: (r["loss"], r["router_bias_max"]) for r in read_metrics(tmp_path / name) if "loss" in r}

    ref = train("single", {}, {"interval": 0})
    parallel, batch = AUX_FREE_WRITERS[writer]
    written = train(writer, parallel, {"interval": 1, "keep_last": 4}, batch)
    assert written[1] == pytest.approx(ref[1], rel=2e-5, abs=1e-6)
    assert ref[1][1] > 0  # the checkpoint holds a moved bias
    # one process (ep1, experts whole), and under tensor parallel (the routed blocks whole on each tp rank)
    for name, resumer in (("resumed", {}), ("resumed-tp2", {"tensor_parallel": 2}))[: 2 if "ep2" in writer else 1]:
        # after step 1 (the sign steps of 4 experts can cancel to 0 at even steps)
        resumed = train(name, resumer, {"resume": str(tmp_path / writer / "checkpoints" / "step_00000001")})
        assert sorted(resumed) == [2, 3, 4], name
        for step in (2, 3, 4):
            assert resumed[step] == pytest.approx(ref[step], rel=2e-5, abs=1e-6), name
