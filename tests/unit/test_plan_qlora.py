"""The planner's accounting of QLoRA (fitlm.plan.finetune): LoRA's adapters and saved tensors on a base whose
block Linears are 4-bit NF4 bytes (per ZeRO-3 shard), no O1 half casts of them, torchao's dequantization
working set at the backward peak, no DPO reference copy, the remedy. (The simulation on fake NF4 tensors is held
against a measured profile by tests/distributed/test_plan_accuracy.py's qlora rows.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fitlm.config import validate_dict
from fitlm.plan import finetune as ft
from fitlm.plan.analytic import breakdown
from fitlm.plan.setup import embedding_params, from_config, head_params

pytest.importorskip("torchao")

# q/o 128x128, k/v 64x128, MLP 256x128: every Linear whole groups of 64 x 256 weights (and their halves at dp2)
MODEL = {
    "arch": "llama",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 512,
    "max_seq_len": 64,
    "tie_embeddings": False,
}
LINEARS = [128 * 128, 64 * 128, 64 * 128, 128 * 128, 256 * 128, 256 * 128, 256 * 128]


def _setup(method: str, level: str = "O2", model: dict | None = None, **sections):
    cfg = {
        "model": {**MODEL, **(model or {})},
        "memory": {"mixed_precision": level},
        "finetune": {"method": method, "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "data": {"seq_length": 64},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return from_config(validate_dict(cfg))


def _nf4(numel: int, shards: int = 1) -> float:
    """torchao's NF4 bytes, written out: 4-bit codes, an int8 scale per 64, a bf16 factor per group of 256 scales
    (128 or 64 where the weights are not whole groups of 256), a 16-entry bf16 code table and a bf16 mean."""
    local = numel // shards
    group = next(g for g in (256, 128, 64) if local % (64 * g) == 0)
    return local / 2 + local / 64 + 2 * local / (64 * group) + 34


def test_nf4_linears_cost_their_4_bit_bytes_not_half_weights():
    s = _setup("qlora")
    layers = s.cfg.model.num_layers
    rest = embedding_params(s) + head_params(s) + layers * (s.counts.block_params - sum(LINEARS))  # norms
    adapters = ft.adapter_params(s)
    b = breakdown(s)
    assert b.params == int(2 * rest + layers * sum(_nf4(n) for n in LINEARS) + 4 * adapters)  # O2: the rest in half
    assert dict(b.param_parts)[ft.NF4_PARAMS] == int(layers * sum(_nf4(n) for n in LINEARS))
    lora = breakdown(replace(s, method="lora"))
    assert lora.params - b.params == int(layers * sum(2 * n - _nf4(n) for n in LINEARS))
    assert (b.optimizer, ft.trainable_params(s)) == (lora.optimizer, adapters)


def test_zero3_shards_the_codes_and_gathers_one_block():
    s = _setup("qlora", model={"vocab_size": 128}, parallel={"data_parallel": 2, "zero_stage": 3})
    b = breakdown(s)
    assert dict(b.param_parts)[ft.NF4_PARAMS] == int(2 * sum(_nf4(n, 2) for n in LINEARS))
    gathered = dict(b.other_parts)["ZeRO-3 gathered blocks"]
    block_rest = s.counts.block_params - sum(LINEARS) + ft.rank_block_adapters(s)
    # both ranks' codes (each quantized in groups its shard holds whole) under one code table and mean; O2
    # gathers the rest in half
    assert gathered == int(2 * block_rest + sum(2 * _nf4(n, 2) - 34 for n in LINEARS))


def test_linears_whose_groups_do_not_fit_stay_in_the_base_storage():
    """h64 / MLP 176: only q and o are whole groups of 64 x 64; k, v and the MLP stay half weights."""
    s = _setup("qlora", model={"hidden_size": 64, "intermediate_size": 176})
    assert ft.nf4_params(s) == 2 * 2 * 64 * 64
    lora = breakdown(replace(s, method="lora"))
    assert lora.params - breakdown(s).params == int(
        2 * 2 * (2 * 64 * 64 - (64 * 64 * (1 / 2 + 1 / 64 + 2 / 64**2) + 34))
    )


def test_o1_keeps_no_half_casts_of_nf4_weights_and_the_dequantization_is_a_named_part():
    s = _setup("qlora", level="O1", model={"vocab_size": 128})  # small logits: the peak is in backward
    lora = replace(s, method="lora")
    nf4_block = sum(LINEARS)
    assert ft.block_cast_params(lora, 1) - ft.block_cast_params(s, 1) == nf4_block
    b = breakdown(s)
    tokens = s.rows * s.seq
    assert dict(b.activation_parts)[ft.DEQUANT] == 14 * 256 * 128 + tokens * 256 * 2  # gate/up: [tokens, f] bf16
    assert ft.dequant_bytes(lora, tokens) == 0 and ft.DEQUANT not in dict(breakdown(lora).activation_parts)


def test_dpo_reference_is_the_base_with_adapters_off():
    s = replace(_setup("qlora"), objective="dpo")
    assert not ft.reference_copy(s) and ft.reference_bytes(s) == 0


def test_diagnosis_offers_qlora_when_fine_tuning_a_pretrained_model():
    from fitlm.plan.diagnose import remedies

    s = _setup("full")
    s = replace(s, cfg=s.cfg.model_copy(update={"model": s.cfg.model.model_copy(update={"init_from": "/models/base"})}))
    changes = {r.change.split(" (")[0]: r for r in remedies(s)}
    assert changes["finetune.method: qlora"].memory.params < changes["finetune.method: lora"].memory.params
    tp = replace(s, tp=2, dp=1)  # tensor parallel refuses QLoRA (fitlm.rules): not offered
    assert not any(r.change.startswith("finetune.method: qlora") for r in remedies(tp))


@pytest.mark.process
def test_simulation_runs_qlora_on_linears_with_biases():
    """Qwen2's q/k/v carry biases: the simulation replaces only the NF4 weight of such a Linear (a fake bias
    cannot be swapped), and finds the parameters the analytic plan counts."""
    from fitlm.plan.simulate import run_step

    s = _setup("qlora", model={"arch": "qwen2"})
    simulated = run_step(s.cfg)
    assert simulated["params"] == pytest.approx(breakdown(s).params, rel=0.01)
