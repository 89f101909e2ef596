"""QLoRA on a transformers-made Qwen3-MoE (a dense block among routed ones) under expert parallel: each ep rank
holds its E/ep experts' 4-bit NF4 codes ([E/ep·out, in], a DTensor Shard(0) over "ep"), ZeRO-3 shards the dense
Linears' codes over dp and, with replicas of the same experts (dp4 × ep2), the experts' over those too. Each
layout trains the same adapters as one process (on attention and on every expert): the same losses and gradient
norms, a merged model on the same 4-bit base (the experts gathered from the ep ranks as [E, out, in]); each rank
holds its share of the one-process NF4 bytes, and the planner's NF4 bytes of each layout are the measured ones.
dp2 × ep2 ZeRO-3 at O2 too, against one process at O2 (FSDP2 casts the dense units, the experts it leaves out cast
their own parameters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_world
from tests.distributed.test_lora_layouts import HALF, REPLICA, worker
from tests.distributed.test_qlora_moe_layouts import HF, QLORA, assert_same_base, planned_nf4_bytes, run_config
from tests.e2e.helpers import hf_qwen3_moe

pytest.importorskip("torchao")

# As test_qlora_moe_layouts' model with as many key/value heads as query heads: k_proj and v_proj [256, 256], so
# every Linear's quarter (dp4 ZeRO-3) is whole double-quantization groups of 256, as one process groups it.
MODEL = {**HF, "num_key_value_heads": 8}
QUARTER = {"micro_batch_size": 1, "gradient_accumulation_steps": 2}  # four data-parallel ranks, same global batch
O2 = {"mixed_precision": "O2"}
# name -> (parallel, train, row shards of a dense Linear's codes, row shards of the experts, memory)
TWO_RANKS = {
    "dp2-ep2-zero0": ({"data_parallel": 2, "expert_parallel": 2}, HALF, 1, 2, {}),
    "dp2-ep2-zero3": ({"data_parallel": 2, "expert_parallel": 2, "zero_stage": 3}, HALF, 2, 2, {}),
    # O2 under ZeRO-3: FSDP2's policy casts the dense units, the experts it leaves out (edp 1) cast their own
    "dp2-ep2-zero3-O2": ({"data_parallel": 2, "expert_parallel": 2, "zero_stage": 3}, HALF, 2, 2, O2),
}
FOUR_RANKS = {"dp4-ep2-zero3": ({"data_parallel": 4, "expert_parallel": 2, "zero_stage": 3}, QUARTER, 4, 4, {})}
EXPERTS = {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 2) for p in ("gate_proj", "up_proj", "down_proj")}
TABLE = 16 * 2 + 2  # the code table and the mean, which each shard keeps whole


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qlora_moe_ep")
    hf = hf_qwen3_moe(root / "hf", 0, **MODEL)
    (hf / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    cfgs = {"single": run_config(tiny_corpus, root, hf, "single", {}, REPLICA)}
    cfgs["single-O2"] = {**run_config(tiny_corpus, root, hf, "single-O2", {}, REPLICA), "memory": O2}
    one = run_world(worker, __name__, 1, cfgs, root, 300, "one-process MoE QLoRA")[0]
    assert EXPERTS <= one["single"]["nf4"].keys()  # the experts of both routed blocks are 4-bit in one process
    return {"root": root, "hf": hf, "corpus": tiny_corpus, "one": one}


def check_layouts(reference: dict, layouts: dict, world: int) -> None:
    root = reference["root"]
    cases = {
        name: {**run_config(reference["corpus"], root, reference["hf"], name, parallel, train), "memory": memory}
        for name, (parallel, train, _, _, memory) in layouts.items()
    }
    ranks = run_world(worker, __name__, world, cases, root, 600, f"MoE QLoRA under expert parallel ({world} ranks)")
    for name, (_, _, dense, experts, memory) in layouts.items():
        single = "single-O2" if memory else "single"
        one = reference["one"][single]
        for r in (r[name] for r in ranks):  # each rank holds its experts' rows and its share of the dense codes
            assert r["nf4"].keys() == one["nf4"].keys(), name
            for weight, size in r["nf4"].items():
                shards = experts if weight in EXPERTS else dense
                assert size - TABLE == (one["nf4"][weight] - TABLE) // shards, (name, weight)
            assert planned_nf4_bytes(cases[name]) == sum(r["nf4"].values()), name
        first = ranks[0][name]
        assert all(r[name]["losses"] == first["losses"] for r in ranks), name
        # O2: bf16 matmuls at half the micro batch round differently (test_qlora_layouts' bounds)
        loss_rel, norm_rel = (1e-4, 2e-3) if memory else (2e-5, 1e-4)
        assert first["losses"] == pytest.approx(one["losses"], rel=loss_rel, abs=1e-5), name
        assert first["grad_norms"] == pytest.approx(one["grad_norms"], rel=norm_rel, abs=1e-5), name
        assert_same_base(root / name, root / single, QLORA["lora"]["alpha"] / QLORA["lora"]["r"])


def test_qlora_moe_under_ep2_holds_each_ranks_4bit_experts_and_equals_one_process(reference):
    check_layouts(reference, TWO_RANKS, 2)


@pytest.mark.slow
def test_qlora_moe_under_dp4_ep2_zero3_shards_the_4bit_experts_over_their_replicas_too(reference):
    check_layouts(reference, FOUR_RANKS, 4)


def test_checkpoint_from_qlora_ep2_resumes_in_one_process(reference, tmp_path):
    """A checkpoint written by `fitlm train` (torchrun) under dp2 × ep2 QLoRA (the expert adapters DTensors over the
    ep ranks; the 4-bit base left out, quantized again from init_from) resumes in one process, which then trains on
    as the uninterrupted one-process run does."""
    from tests.e2e.helpers import fitlm, read_metrics, write_config

    def train(name: str, parallel: dict, batch: dict, checkpoint: dict) -> dict[int, float]:
        cfg = run_config(reference["corpus"], tmp_path, reference["hf"], name, parallel, {"max_steps": 4, **batch})
        proc = fitlm("train", write_config(tmp_path / f"{name}.yaml", {**cfg, "checkpoint": checkpoint}), "--json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r}

    ref = train("single", {}, REPLICA, {"interval": 0})
    written = train("ep2", TWO_RANKS["dp2-ep2-zero0"][0], HALF, {"interval": 2})
    assert [written[s] for s in (1, 2)] == pytest.approx([ref[s] for s in (1, 2)], rel=2e-5, abs=1e-5)
    resumed = train("resumed", {}, REPLICA, {"resume": str(tmp_path / "ep2" / "checkpoints" / "step_00000002")})
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == pytest.approx([ref[s] for s in (3, 4)], rel=2e-5, abs=1e-5)
