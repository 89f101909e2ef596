"""The planner counts an MoE model's blocks as the model builds them (fitlm.plan.setup.block_kinds): the dense
blocks among routed ones (model.mlp_only_layers, decoder_sparse_step) with their own MLP, and under QLoRA the
stacked experts at their 4-bit bytes (fitlm.plan.finetune.nf4_linears), checked against the model itself built
on meta with `apply_finetune` (parameters, adapters, NF4 weights and their bytes, exactly). The peak against a
measured profile: tests/distributed/test_plan_accuracy.py's `moe dense1` rows."""

from __future__ import annotations

import pytest
import torch

from fitlm.config import validate_dict
from fitlm.finetune.apply import apply_finetune
from fitlm.memory import nf4
from fitlm.parallel.pipeline import build_stage_modules
from fitlm.plan import finetune as ft
from fitlm.plan.analytic import stage_params
from fitlm.plan.expert_parallel import alltoall_seconds, experts_per_device, stage_expert_params
from fitlm.plan.setup import from_config, total_params
from fitlm.registry import build_model
from tests.distributed.test_plan_accuracy import MOE_DENSE1

pytest.importorskip("torchao")

# the accuracy test's issue-55 model (16 experts of width 128, top 4, vocabulary 1,024) with four blocks, laid out below
MODEL = {**{k: v for k, v in MOE_DENSE1.items() if k != "mlp_only_layers"}, "num_layers": 4, "max_seq_len": 64}
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
LAYOUTS = {  # dense blocks: [1]; every second block routed (blocks 1 and 3); all four routed
    "mlp_only_layers": {"mlp_only_layers": [1]},
    "decoder_sparse_step": {"decoder_sparse_step": 2},
    "all routed": {},
}


def _config(method: str, layout: dict):
    return validate_dict(
        {
            "model": {**MODEL, **layout},
            "memory": {"mixed_precision": "O2"},
            "finetune": {"method": method, "lora": {"r": 8, "target_modules": TARGETS}},
            "data": {"seq_length": 64},
        }
    )


def _built(cfg):
    with torch.device("meta"):
        model = build_model(cfg.model)
    apply_finetune(model, cfg)
    return model


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_parameters_adapters_and_4bit_experts_are_the_built_models(method, layout):
    cfg = _config(method, layout)
    s, model = from_config(cfg), _built(cfg)
    params = list(model.parameters())
    trained = sum(p.numel() for p in params if p.requires_grad)
    assert ft.trainable_params(s) == trained
    assert total_params(s) + (trained if method != "full" else 0) == sum(p.numel() for p in params)
    stored = [p for p in params if nf4.is_nf4(p)]
    assert ft.nf4_params(s) == sum(p.numel() for p in stored)
    assert ft.nf4_rank_bytes(s) == sum(nf4.nf4_bytes(p.numel(), p.scaler_block_size) for p in stored)
    routed = sum(cfg.model.sparse_layer(i) for i in range(cfg.model.num_layers))
    assert experts_per_device(s) == routed * 16
    if method == "qlora":  # every expert projection of every routed block is 4-bit ([E·out, in])
        experts = [n for n, p in model.named_parameters() if nf4.is_nf4(p) and ".experts." in n]
        assert len(experts) == 3 * routed


@pytest.mark.parametrize("shards", [2, 16])
def test_qlora_under_zero3_shards_the_4bit_experts_and_the_plan_says_so(shards):
    # (expert parallel with QLoRA is refused by fitlm.rules; ZeRO-3 shards every weight's rows, the experts' 16 too)
    parallel = {"data_parallel": shards, "zero_stage": 3}
    cfg = validate_dict({**_config("qlora", LAYOUTS["mlp_only_layers"]).to_dict(), "parallel": parallel})
    s, model = from_config(cfg), _built(cfg)
    stored = {n: p for n, p in model.named_parameters() if nf4.is_nf4(p)}
    assert len([n for n in stored if ".experts." in n]) == 3 * 3  # every routed block's three projections
    assert ft.nf4_params(s) == sum(p.numel() for p in stored.values())
    assert ft.nf4_rank_bytes(s) == sum(nf4.nf4_bytes(p.numel() // shards, p.scaler_block_size) for p in stored.values())


def test_qlora_under_zero3_keeps_experts_the_shards_would_cut_in_half_and_the_plan_says_so():
    shards = 32  # 16 experts over 32 ranks: a rank's rows would hold half an expert
    parallel = {"data_parallel": shards, "zero_stage": 3}
    cfg = validate_dict({**_config("qlora", LAYOUTS["mlp_only_layers"]).to_dict(), "parallel": parallel})
    s, model = from_config(cfg), _built(cfg)
    stored = {n: p for n, p in model.named_parameters() if nf4.is_nf4(p)}
    assert not any(".experts." in n for n in stored)
    assert ft.nf4_params(s) == sum(p.numel() for p in stored.values())
    assert ft.nf4_rank_bytes(s) == sum(nf4.nf4_bytes(p.numel() // shards, p.scaler_block_size) for p in stored.values())


@pytest.mark.parametrize("layers", [4, 3])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_pipeline_stages_count_the_blocks_they_hold(layout, layers):
    """Under pp2 each stage's parameters and experts are those of the blocks fitlm.parallel.pipeline gives it (the
    first takes the extra block of an odd count), a dense block counted on the stage that holds it, not L/pp of
    the model's mean block."""
    cfg = validate_dict(
        {**_config("full", {**layout, "num_layers": layers}).to_dict(), "parallel": {"pipeline_parallel": 2}}
    )
    s, model = from_config(cfg), _built(cfg)
    for rank, first in [(0, True), (1, False)]:
        ((_, stage),) = build_stage_modules(model, rank, 2, "1f1b")
        assert stage_params(s, first) == sum(p.numel() for p in stage.parameters())
        experts = sum(p.numel() for n, p in stage.named_parameters() if ".experts." in n)
        assert stage_expert_params(s, first) == experts


def test_all_to_all_time_counts_the_routed_blocks_only():
    """A dense block among routed ones dispatches nothing: 3 of the 4 blocks' all-to-alls under mlp_only_layers."""
    ep2 = {"parallel": {"data_parallel": 2, "expert_parallel": 2}}

    def seconds(layout: dict) -> float:
        s = from_config(validate_dict({**_config("full", layout).to_dict(), **ep2}))
        return alltoall_seconds(s, 256, 2, 1e9, 1e-5)

    assert seconds(LAYOUTS["mlp_only_layers"]) == pytest.approx(3 / 4 * seconds(LAYOUTS["all routed"]))
