"""QLoRA on a transformers-made Qwen3-MoE (a dense block among routed ones) under ZeRO-2 and ZeRO-3 at dp2 keeps
its stacked experts in 4-bit NF4, sharded by FSDP2 like a Linear's codes ([E·out, in] by rows: four whole experts a
rank), and trains the same adapters as one process: the same losses and gradient norms, a merged model on the same
4-bit base; each rank holds half of the one-process NF4 bytes, and the planner's NF4 parameter bytes of each layout
are the measured ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import run_world
from tests.distributed.test_lora_layouts import HALF, REPLICA, saved, worker
from tests.distributed.test_qlora_layouts import config
from tests.e2e.helpers import hf_qwen3_moe

pytest.importorskip("torchao")

QLORA = {
    "method": "qlora",
    "lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]},
}
# A Qwen3-MoE as transformers makes it (hf_qwen3_moe: block 1 dense, its MLP three Linears; 0 and 2 routed), every
# Linear and each expert [128, 256] whole double-quantization groups of 256, and so each half at dp2: one process
# and two ranks quantize alike.
HF = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
ZERO = {z: {"data_parallel": 2, "zero_stage": z} for z in (2, 3)}


def planned_nf4_bytes(cfg: dict) -> float:
    from fitlm.plan import finetune as ft
    from fitlm.plan.setup import from_config
    from fitlm.run_config import run_config

    return ft.nf4_rank_bytes(from_config(run_config(cfg, None)[0]))  # (init_from read as the CLI reads it)


def run_config(corpus: dict, root, hf, name: str, parallel: dict, train: dict) -> dict:
    """The tiny run's config on the checkpoint `hf`, its model section `init_from` alone."""
    return {**config(corpus, root, name, parallel, train, {}, QLORA), "model": {"init_from": str(hf)}}


def test_qlora_moe_under_zero2_and_zero3_shards_the_4bit_experts_and_equals_one_process(tiny_corpus, tmp_path):
    hf = hf_qwen3_moe(tmp_path / "hf", 0, **HF)
    (hf / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    single_cfg = run_config(tiny_corpus, tmp_path, hf, "single", {}, REPLICA)
    cases = {f"dp2-zero{z}": run_config(tiny_corpus, tmp_path, hf, f"dp2-zero{z}", ZERO[z], HALF) for z in ZERO}
    one = run_world(worker, __name__, 1, {"single": single_cfg}, tmp_path, 300, "one-process MoE QLoRA")[0]["single"]
    ranks = run_world(worker, __name__, 2, cases, tmp_path, 420, "MoE QLoRA at dp2 ZeRO-2/3")
    experts = {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 2) for p in ("gate_proj", "up_proj", "down_proj")}
    assert experts <= one["nf4"].keys()  # the experts of both routed blocks are 4-bit in one process
    assert planned_nf4_bytes(single_cfg) == sum(one["nf4"].values())  # the planner's NF4 bytes are what it holds
    table = 16 * 2 + 2  # the code table and the mean, which each shard keeps whole
    for name, cfg in cases.items():
        two = [r[name] for r in ranks]
        for r in two:  # and on each rank, which holds half of their codes, scales and factors
            assert experts <= {n.replace("_fsdp_wrapped_module.", "") for n in r["nf4"]}, name
            assert r["nf4"].keys() == one["nf4"].keys(), name
            for weight, size in r["nf4"].items():
                assert size - table == (one["nf4"][weight] - table) // 2, (name, weight)
        assert sum(two[0]["nf4"].values()) == pytest.approx(sum(one["nf4"].values()) / 2, rel=1e-3)
        assert planned_nf4_bytes(cfg) == sum(two[0]["nf4"].values()), name
        assert two[1]["losses"] == two[0]["losses"], name
        assert two[0]["losses"] == pytest.approx(one["losses"], rel=2e-5, abs=1e-5), name
        assert two[0]["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4, abs=1e-5), name
        assert_same_base(tmp_path / name, tmp_path / "single", QLORA["lora"]["alpha"] / QLORA["lora"]["r"])


def assert_same_base(got_dir, want_dir, scaling: float) -> None:
    """The merged models of two runs differ by their adapters' scaling · B·A alone: each folded its adapter into
    the same dequantized 4-bit base (the experts' gathered from the ranks' shards as [E, out, in]). Their adapters
    are not held to each other: Adam moves an entry whose gradient is rounding noise (the MoE's routed sums add
    in another order at half the micro batch, as plain LoRA's do) by up to lr a step, whichever sign."""
    got, want = saved(got_dir), saved(want_dir)
    assert got["model"].keys() == want["model"].keys()
    assert got["adapter"].keys() == want["adapter"].keys() and got["adapter_config"] == want["adapter_config"]
    assert any(".experts.7.down_proj." in k for k in got["adapter"])  # every expert's adapter is exported
    for name, weight in want["model"].items():
        a = "base_model.model." + name.replace(".weight", ".lora_A.weight")
        b = a.replace(".lora_A.", ".lora_B.")
        delta = (got["model"][name].double() - weight.double()).reshape(weight.shape)
        if a in want["adapter"]:
            mine, theirs = got["adapter"], want["adapter"]
            delta -= scaling * (mine[b].double() @ mine[a].double() - theirs[b].double() @ theirs[a].double())
        torch.testing.assert_close(delta, torch.zeros_like(delta), rtol=0, atol=1e-6, msg=name)
