"""The planner under expert parallel (fitlm/plan/expert_parallel.py): a rank holds E/ep of every block's experts,
whole at ZeRO 0/1 or without replicas, sharded over their replicas (edp) under ZeRO-2/3, while the dense part shards
as before; the all-to-alls are in the step time; the search tries
expert_parallel on MoE models only; the MoE scenario configs plan as their comments say. (Against measured
steps: tests/distributed/test_plan_accuracy.py's qwen3_moe rows.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from fitlm.config import load_config, validate_dict
from fitlm.plan.devices import get_device
from fitlm.plan.report import plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
H, L, E, WIDTH, V = 64, 2, 4, 32, 512
MOE = {
    "arch": "qwen3_moe",
    "hidden_size": H,
    "num_layers": L,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 96,
    "num_experts": E,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": WIDTH,
    "vocab_size": V,
    "max_seq_len": 64,
}
EXPERTS = L * E * 3 * H * WIDTH  # every block's stacked gate, up and down projections


def per_device(parallel: dict, model: dict = MOE, **sections) -> dict:
    cfg = validate_dict({"model": model, "data": {"seq_length": 64}, "parallel": parallel, **sections})
    return plan(cfg, get_device("a100-80g"))


def test_a_rank_holds_its_share_of_the_experts_sharded_over_their_replicas_by_zero_2_and_3():
    one = per_device({"data_parallel": 2})["per_device"]
    ep2 = per_device({"data_parallel": 2, "expert_parallel": 2})["per_device"]
    assert one["params"] - ep2["params"] == EXPERTS // 2 * 4  # O0: fp32, half the experts gone
    assert one["optimizer"] - ep2["optimizer"] == EXPERTS // 2 * 8  # AdamW's two moments
    dense = one["params"] // 4 - EXPERTS  # parameters outside the experts
    z3 = per_device({"data_parallel": 4, "expert_parallel": 2, "zero_stage": 3})["per_device"]
    # dense over dp4; experts E/2 a rank, sharded over their 2 replicas (FSDP2 over edp)
    assert z3["params"] == (dense / 4 + EXPERTS / 2 / 2) * 4
    assert z3["optimizer"] == (dense / 4 + EXPERTS / 2 / 2) * 8
    z2 = per_device({"data_parallel": 4, "expert_parallel": 2, "zero_stage": 2})["per_device"]
    assert z2["params"] == z3["params"] and z2["optimizer"] == z3["optimizer"]  # FSDP2 at rest: the same shards
    z3_ep4 = per_device({"data_parallel": 4, "expert_parallel": 4, "zero_stage": 3})["per_device"]
    assert z3_ep4["params"] == (dense / 4 + EXPERTS / 4) * 4  # no replicas (edp 1): the experts E/4, whole
    z3_no_ep = per_device({"data_parallel": 4, "zero_stage": 3})["per_device"]
    assert z3_no_ep["params"] == (dense + EXPERTS) / 4 * 4  # without ep ZeRO-3 shards the experts over dp


def test_tensor_parallel_splits_each_expert_on_its_width():
    """Tensor parallel splits attention, the dense MLPs, embedding and head, and each expert inside on its width
    (fitlm.parallel.expert_tensor_parallel): a rank holds 1/tp of every expert it holds, E/ep of them."""
    one = per_device({})["per_device"]
    tp2_plan = per_device({"tensor_parallel": 2})
    tp2 = tp2_plan["per_device"]
    dense = one["params"] // 4 - EXPERTS
    assert tp2["params"] == (dense + EXPERTS) / 2 * 4
    assert tp2_plan["model"]["expert_width_split"] == 2  # the report: "(1/2 of each)"
    ep2_tp2 = per_device({"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2})["per_device"]
    assert ep2_tp2["params"] == (dense / 2 + EXPERTS / 2 / 2) * 4  # experts split over ep, then each over tp


def test_lora_leaves_the_experts_frozen():
    lora = {"finetune": {"method": "lora"}, "memory": {"mixed_precision": "O2"}}
    full = per_device({"data_parallel": 2, "expert_parallel": 2}, memory={"mixed_precision": "O2"})
    low = per_device({"data_parallel": 2, "expert_parallel": 2}, **lora)
    # AdamW's fp32 moments for the adapters alone: the experts have none
    assert low["per_device"]["optimizer"] == 8 * low["finetune"]["trainable_params_per_rank"]
    assert full["per_device"]["params"] - low["per_device"]["params"] >= EXPERTS // 2 * 2  # frozen in bf16


def test_all_to_alls_are_in_the_step_and_their_buffers_in_memory():
    no_ep = per_device({"data_parallel": 2})
    ep2 = per_device({"data_parallel": 2, "expert_parallel": 2})
    assert no_ep["time_breakdown_s"]["expert_parallel_all_to_all"] == 0.0
    assert ep2["time_breakdown_s"]["expert_parallel_all_to_all"] > 0.0
    tokens = 8 * 64  # micro batch 8 of 64 tokens, each to its top-2 experts, 64 wide, fp32, sent and received
    assert ep2["other_parts"]["expert-parallel all-to-all buffers"] == 2 * tokens * 2 * H * 4
    assert "DDP buckets beside unsynced gradients" not in ep2["other_parts"]  # expert parallel runs without DDP
    assert ep2["layout"].startswith("dp2×tp1×pp1×ep2")


def test_the_search_tries_expert_parallel_on_moe_models_only():
    moe = validate_dict({"model": MOE, "data": {"seq_length": 64}, "parallel": {"data_parallel": 4}})
    found = plan(moe, get_device("a100-80g"), 4, search=True, top=50)["search"]["top"]
    assert any("×ep2" in c["layout"] for c in found) and any("×ep4" in c["layout"] for c in found)
    found = plan(moe, get_device("a100-80g"), 4, search=True, top=10_000)["search"]["top"]
    layouts = {c["layout"] for c in found}  # with tensor and context parallel and ZeRO-1 too
    for wanted in ("dp2×tp2×pp1 ", "dp2×tp2×pp1×ep2 ", "dp2×tp1×pp1×cp2×ep2 ", "dp4×tp1×pp1×ep2 zero1"):
        assert any(name.startswith(wanted) for name in layouts), (wanted, sorted(layouts))
    dense = validate_dict({"model": {**MOE, "arch": "qwen3", "num_experts": None}, "data": {"seq_length": 64}})
    found = plan(dense, get_device("a100-80g"), 4, search=True, top=50)["search"]["top"]
    assert found and not any("×ep" in c["layout"] for c in found)


@pytest.mark.parametrize(
    "name,device,overrides,fits",
    [
        ("qwen3-30b-a3b-lora-8x80gb", "a100-80g", [], True),
        ("qwen3-30b-a3b-qlora-24gb", "rtx4090", [], True),
        ("mixtral-8x7b-16x80gb", "h100-80g", [], True),
        # experts split over 8 ranks, each expert's shard over its 2 replicas (as its comment says)
        ("mixtral-8x7b-16x80gb", "h100-80g", ["parallel.expert_parallel=8"], True),
        ("mixtral-8x7b-16x80gb", "h100-80g", ["parallel.expert_parallel=8", "parallel.zero_stage=0"], False),
    ],
)
def test_the_moe_scenarios_plan_as_their_comments_say(name, device, overrides, fits):
    result = plan(load_config(CONFIGS / f"{name}.yaml", overrides), get_device(device))
    assert 30e9 < result["model"]["params"] < 50e9
    assert result["fits"] is fits, (result["per_device"], result.get("diagnosis"))
    if not fits:
        assert result["diagnosis"]["dominant"] == "optimizer"  # whole experts with their fp32 AdamW states


@pytest.mark.parametrize(
    "model",
    [
        MOE,
        {**MOE, "num_experts_per_tok": 3, "num_experts": 6},
        {**MOE, "arch": "qwen2_moe", "shared_expert_intermediate_size": 48},
        {**{k: v for k, v in MOE.items() if k != "moe_intermediate_size"}, "arch": "mixtral"},
        {k: v for k, v in MOE.items() if k not in ("num_experts", "moe_intermediate_size")} | {"arch": "llama"},
    ],
    ids=["qwen3_moe", "top3_of_6", "qwen2_moe_shared", "mixtral", "dense"],
)
def test_the_step_counts_the_flops_of_the_routed_experts_as_the_trainer_does(model):
    """6·N per token with N the routed experts' parameters (k of E), equal to the trainer's MFU numerator."""
    from fitlm.models.flops import flops_per_token
    from fitlm.plan.setup import from_config
    from fitlm.plan.throughput import timing
    from fitlm.registry import build_model

    cfg = validate_dict({"model": model, "data": {"seq_length": 64}})
    planned = timing(from_config(cfg), get_device("a100-80g")).flops_per_token
    assert planned == flops_per_token(build_model(cfg.model), cfg.model, 64)


def test_a_pipeline_stage_holds_the_experts_of_its_blocks():
    """pp2 on a 4-block MoE: the first stage holds the embeddings and two blocks with their experts; the plan counts
    2·E experts per device, and E/ep of those under expert parallel's count."""
    model = {**MOE, "num_layers": 4}
    one = per_device({}, model)
    pp2 = per_device({"pipeline_parallel": 2, "micro_batch_num": 2}, model)
    assert one["model"]["experts"] == pp2["model"]["experts"] == 4 * E
    assert (one["model"]["experts_per_device"], pp2["model"]["experts_per_device"]) == (4 * E, 2 * E)
    block = (one["model"]["params"] - 2 * V * H - H) / 4  # untied: embeddings and head V×H each, the final norm H
    assert pp2["per_device"]["params"] == (V * H + 2 * block) * 4  # O0: fp32; the experts are in `block`
    assert 2 * E * 3 * H * WIDTH < 2 * block  # (the two blocks do hold 2·E experts' weights)
    assert "experts" not in per_device({}, {**MOE, "arch": "qwen3", "num_experts": None})["model"]


def test_simulate_runs_an_moe_pipeline_step_with_its_aux_loss_pass():
    """`fitlm plan --simulate` runs the training step on fake tensors; under pipeline parallel an MoE model's step
    also runs the aux loss's counting pass (fitlm/step/pipeline_balance.py), which must take fake tensors too."""
    model = {**MOE, "num_layers": 4, "mlp_only_layers": [1], "router_aux_loss_coef": 0.01}
    cfg = validate_dict(
        {
            "model": model,
            "data": {"seq_length": 64},
            "parallel": {"pipeline_parallel": 2, "micro_batch_num": 2},
            "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 2},
        }
    )
    result = plan(cfg, get_device("a100-80g"), simulate=True)
    assert result["simulated"]["per_device"]["total"] > 0
    assert result["model"]["experts_per_device"] == 2 * E  # the last stage's blocks 2 and 3 (the first: 0, dense 1)


@pytest.mark.parametrize(
    "parallel",
    [{"data_parallel": 2, "expert_parallel": 2}, {"data_parallel": 4, "expert_parallel": 2, "zero_stage": 3}],
    ids=["ep2", "dp4-ep2-zero3"],
)
def test_simulate_runs_expert_parallel_with_balanced_routing(parallel):
    """`--simulate` under expert parallel: the all-to-alls split by an even routing (fake tensors hold no routed
    counts), and the simulated model states are the analytic ones (experts E/ep a rank, sharded over edp under
    ZeRO-3). Against measured steps: tests/distributed/test_plan_accuracy.py's qwen3_moe rows."""
    cfg = validate_dict({"model": MOE, "data": {"seq_length": 64}, "parallel": parallel})
    result = plan(cfg, get_device("a100-80g"), simulate=True)
    simulated, analytic = result["simulated"]["per_device"], result["per_device"]
    assert "error" not in result["simulated"]
    for part in ("params", "optimizer"):
        assert simulated[part] == pytest.approx(analytic[part], rel=0.02), part
    assert simulated["activations"] > 0


@pytest.mark.parametrize(
    "parallel",
    [{"data_parallel": 4, "zero_stage": 3}, {"data_parallel": 4, "expert_parallel": 2, "zero_stage": 3}],
    ids=["dp4-zero3", "dp4-ep2-zero3"],
)
def test_fewer_experts_than_ranks_shard_each_experts_rows(parallel):
    """Two wide experts over four ZeRO-3 ranks (or one a rank under ep2, over its two replicas): FSDP2 splits each
    expert's rows (fitlm.parallel.expert_parallel.expert_shard_placement); on dim 0 it would pad every rank to a
    whole expert. The simulated step runs the real sharding: its AdamW states are the even shares (its parameters at
    the peak also hold a gathered block)."""
    model = {**MOE, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 1024}
    cfg = validate_dict({"model": model, "data": {"seq_length": 64}, "parallel": parallel})
    result = plan(cfg, get_device("a100-80g"), simulate=True)
    simulated, analytic = result["simulated"]["per_device"], result["per_device"]
    assert simulated["optimizer"] == pytest.approx(analytic["optimizer"], rel=0.01)


@pytest.mark.slow  # a fake world per layout: about 15 s each on 2 cores
@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel": 2, "sequence_parallel": True}, {"data_parallel": 2, "context_parallel": 2, "zero_stage": 1}],
    ids=["tp2-sp", "dp2-cp2-zero1"],
)
def test_simulate_runs_an_moe_step_under_tensor_and_context_parallel(parallel):
    """The fake-tensor step through the routed blocks' experts split over tp (the gather, the partial output's
    reduce-scatter and the input gradient's all-reduce), and the
    aux loss's counts summed over the cp ranks."""
    model = {**MOE, "mlp_only_layers": [1], "router_aux_loss_coef": 0.01}
    cfg = validate_dict({"model": model, "data": {"seq_length": 64}, "parallel": parallel})
    assert plan(cfg, get_device("a100-80g"), simulate=True)["simulated"]["per_device"]["total"] > 0
