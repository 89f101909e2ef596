"""The planner's accounting of DPO (2 rows per pair, the frozen reference copy) and of LoRA / freeze under
tensor and pipeline parallel (per-rank adapters, per-stage trainable parameters): analytic, and one
single-process simulation on fake tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.distributed.tensor import Replicate, Shard

from fitlm.config import validate_dict
from fitlm.finetune.lora import apply_lora, is_adapted
from fitlm.parallel.lora_parallel import COLWISE, ROWWISE
from fitlm.plan import finetune as ft
from fitlm.plan.analytic import breakdown
from fitlm.plan.devices import CATALOG
from fitlm.plan.finetune import REFERENCE
from fitlm.plan.setup import from_config, matmul_params, total_params
from fitlm.plan.throughput import timing
from fitlm.registry import build_model

MODEL = {
    "arch": "llama",
    "hidden_size": 64,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_seq_len": 64,
}


def _cfg(finetune: dict, **sections):
    dpo = finetune.get("objective") == "dpo"
    cfg = {
        "model": dict(MODEL),
        "finetune": finetune,
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "data": {"seq_length": 64, "format": "preference" if dpo else "pretrain"},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return validate_dict(cfg)


def _other(s) -> dict[str, int]:
    return dict(breakdown(s).other_parts)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_dpo_doubles_activations_and_logits_of_the_same_micro_batch(method):
    """B pairs are 2B rows: every saved tensor and the logits of twice the sequences (O0: linear in tokens)."""
    sft = breakdown(from_config(_cfg({"method": method})))
    dpo = breakdown(from_config(_cfg({"method": method, "objective": "dpo"})))
    assert dpo.activations == 2 * sft.activations and dpo.logits == 2 * sft.logits
    assert (sft.params, sft.optimizer) == (dpo.params, dpo.optimizer)


def test_dpo_remedies_keep_the_rules_dpo_keeps():
    """DPO refuses the chunked loss and tensor/context parallel (fitlm.rules): the diagnosis offers neither."""
    from fitlm.plan.diagnose import remedies

    s = from_config(_cfg({"method": "full", "objective": "dpo"}, parallel={"data_parallel": 2}))
    changes = [r.change for r in remedies(s)]
    assert changes and not any(
        c.startswith(("memory.loss_chunk_size", "parallel.tensor_parallel", "parallel.context_parallel"))
        for c in changes
    ), changes


def test_reference_copy_for_full_finetuning_none_for_lora_without_a_reference():
    full = from_config(_cfg({"method": "full", "objective": "dpo"}))
    assert _other(full)[REFERENCE] == 4 * total_params(full)  # fp32 at O0
    half = from_config(
        _cfg({"method": "freeze", "freeze_layers": 0.5, "objective": "dpo"}, memory={"mixed_precision": "O2"})
    )
    assert _other(half)[REFERENCE] == 2 * total_params(half)  # O2 stores weights in half
    lora = from_config(_cfg({"method": "lora", "objective": "dpo"}))
    assert REFERENCE not in _other(lora)
    named = replace(
        lora,
        cfg=lora.cfg.model_copy(
            update={
                "finetune": lora.cfg.finetune.model_copy(
                    update={"dpo": lora.cfg.finetune.dpo.model_copy(update={"reference": "/models/other"})}
                )
            }
        ),
    )
    assert _other(named)[REFERENCE] == 4 * total_params(named)  # another model: a copy even under LoRA
    assert REFERENCE not in _other(from_config(_cfg({"method": "full"})))  # SFT: none


def test_zero3_shards_the_policy_but_not_the_reference():
    one = breakdown(from_config(_cfg({"method": "full", "objective": "dpo"})))
    zero3 = breakdown(
        from_config(_cfg({"method": "full", "objective": "dpo"}, parallel={"data_parallel": 2, "zero_stage": 3}))
    )
    assert zero3.params == one.params // 2
    assert dict(zero3.other_parts)[REFERENCE] == dict(one.other_parts)[REFERENCE]


def test_dpo_throughput_counts_both_rows_and_the_reference_forward():
    dev = CATALOG["a100-80g"]
    sft, dpo = (from_config(_cfg({"method": "lora", **o})) for o in ({}, {"objective": "dpo"}))
    assert dpo.tokens_per_step == 2 * sft.tokens_per_step
    fpt = timing(sft, dev).flops_per_token
    assert timing(dpo, dev).flops_per_token == fpt  # model FLOPs: the policy's; the reference is extra work
    reference = 2 * matmul_params(dpo) + 4 * dpo.layers * dpo.h * dpo.seq  # a third of 6N + 12·L·h·s
    assert timing(dpo, dev).compute_s / timing(sft, dev).compute_s == pytest.approx(2 * (fpt + reference) / fpt)


def test_simulate_runs_dpo_with_one_pair_per_micro_batch_and_adds_the_reference():
    """The fake batch is 2 × micro_batch_size rows (one row would be half a pair: the step refuses it)."""
    from fitlm.plan.simulate import run_step

    cfg = _cfg({"method": "full", "objective": "dpo"}, model={"num_layers": 2}, train={"micro_batch_size": 1})
    sim, s = run_step(cfg), from_config(cfg)
    assert sim["other"] >= ft.reference_bytes(s) > 0
    assert abs(breakdown(s).total / sim["total"] - 1) <= 0.05


def _per_rank_adapter_params(model, tp: int, blocks: range) -> int:
    """What one tp rank holds of the blocks' adapters, from lora_parallel's placements: Shard(d) keeps 1/tp of
    the tensor, Replicate all of it; a linear is row-parallel if the family's tp_plan says so."""
    rowwise = tuple(model.config.family.tp_plan.rowwise)
    held = 0
    for name, module in model.named_modules():
        if not is_adapted(module) or int(name.split(".")[2]) not in blocks:  # model.layers.<i>.<path>
            continue
        rule = ROWWISE if name.endswith(rowwise) else COLWISE
        for part in ("lora_A", "lora_B"):
            weight, placement = getattr(module, part).weight, rule[part]["weight"]
            held += weight.numel() // tp if isinstance(placement, Shard) else weight.numel()
            assert isinstance(placement, (Shard, Replicate))
    return held


@pytest.mark.parametrize(
    "parallel", [{"tensor_parallel": 2}, {"tensor_parallel": 2, "pipeline_parallel": 2}, {"pipeline_parallel": 2}]
)
def test_lora_per_rank_trainable_count_matches_a_real_model(parallel):
    cfg = _cfg({"method": "lora", "lora": {"r": 4, "target_modules": ["all-linear"]}}, parallel=parallel)
    model = build_model(cfg.model)
    apply_lora(model, 4, 8.0, 0.0, ["all-linear"])
    s = from_config(cfg)
    for first in (True, False):
        blocks = ft.stage_blocks(s, first)
        assert ft.stage_trainable(s, first) == _per_rank_adapter_params(model, s.tp, blocks)
    if s.tp > 1:  # A of q/k/v/gate/up and B of o/down stay whole: more than the old trainable / tp
        assert ft.stage_trainable(s, True) > ft.trainable_params(s) / s.tp / s.pp


def test_freeze_under_pipeline_parallel_trains_the_last_stage_most():
    s = from_config(_cfg({"method": "freeze", "freeze_layers": 0.5}, parallel={"pipeline_parallel": 2}))
    first, last = ft.stage_trainable(s, True), ft.stage_trainable(s, False)
    assert first == s.counts.embedding_params  # blocks 0-1 frozen, the embedding trains
    assert last == 2 * s.counts.block_params + s.counts.head_norm_params + s.vocab * s.h
    assert breakdown(s).optimizer == 2 * 4 * last  # AdamW's two fp32 moments of the most loaded stage


def test_plan_json_names_the_dpo_reference_and_the_per_rank_trainable_count():
    from fitlm.plan.report import plan

    out = plan(_cfg({"method": "full", "objective": "dpo"}), CATALOG["a100-80g"], 1)
    ref = out["finetune"]["dpo"]["reference_bytes"]
    assert ref == out["other_parts"][REFERENCE] > 0 and out["finetune"]["dpo"]["rows_per_micro_batch"] == 4
    assert sum(out["other_parts"].values()) == out["per_device"]["other"]  # every byte of `other` named
    lora = plan(_cfg({"method": "lora"}, parallel={"tensor_parallel": 2}), CATALOG["a100-80g"], 2)["finetune"]
    assert lora["trainable_params_per_rank"] > lora["trainable_params"] / 2  # A of q/v stays whole


@pytest.mark.slow
@pytest.mark.parametrize(
    "finetune, parallel",
    [
        ({"method": "lora", "lora": {"target_modules": ["all-linear"]}}, {"tensor_parallel": 2}),
        ({"method": "freeze", "freeze_layers": 0.5}, {"pipeline_parallel": 2, "micro_batch_num": 2}),
        ({"method": "lora"}, {"pipeline_parallel": 2, "micro_batch_num": 2}),
    ],
)
def test_finetuning_under_tp_and_pp_agrees_with_the_fake_world_simulation(finetune, parallel):
    """The per-rank adapters and per-stage optimizer states as the real step holds them (fake process group);
    measured here: +1.6% (LoRA all-linear tp2), +1.4% (freeze pp2), +3.8% (LoRA pp2) over the simulation."""
    from fitlm.plan.simulate import run_step

    cfg = _cfg(finetune, parallel=parallel, train={"micro_batch_size": 4})
    sim, plan = run_step(cfg), breakdown(from_config(cfg))
    assert plan.optimizer == pytest.approx(sim["optimizer"], rel=0.01)  # the rest: AdamW's step counters
    assert abs(plan.total / sim["total"] - 1) <= 0.05
