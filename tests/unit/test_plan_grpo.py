"""The planner's accounting of GRPO (fitlm.plan.grpo): the rollout phase's KV cache and sampling logits, the reference
copy under full fine-tuning with beta > 0, the peak phase, the sampling time, and the guide's 24 GB config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fitlm.config import load_config, validate_dict
from fitlm.memory.tracking import peak_live_bytes
from fitlm.models.layers import KVCache
from fitlm.plan import grpo as gp
from fitlm.plan.analytic import ROLLOUT, breakdown
from fitlm.plan.devices import CATALOG
from fitlm.plan.finetune import REFERENCE
from fitlm.plan.report import plan
from fitlm.plan.setup import from_config
from fitlm.plan.throughput import timing
from fitlm.registry import build_model
from fitlm.step.sampler import sample
from tests.e2e.helpers import fitlm
from tests.unit.test_plan_finetune_layouts import MODEL as LAYOUT_MODEL

ROOT = Path(__file__).resolve().parents[2]
MODEL = {**LAYOUT_MODEL, "max_seq_len": 256}  # the DPO tests' small Llama, room for long completions


def _cfg(method: str = "full", level: str = "O0", micro: int = 4, accum: int = 2, **grpo):
    g = {"num_generations": 4, "max_prompt_length": 16, "max_completion_length": 16, "reward_funcs": ["length"]}
    g.update(grpo)
    return validate_dict(
        {
            "model": dict(MODEL),
            "finetune": {"method": method, "objective": "grpo", "grpo": g},
            "memory": {"mixed_precision": level},
            "train": {"micro_batch_size": micro, "gradient_accumulation_steps": accum},
            "data": {"seq_length": g["max_prompt_length"] + g["max_completion_length"], "format": "prompts"},
        }
    )


def test_kv_cache_equals_the_hand_formula_and_the_engine_cache():
    """rows (micro batch × accumulation) × (prompt + completion) × layers × 2 × kv_heads × head_dim × 4 (fp32 at
    O0), and exactly the bytes SlotBatch's KVCache allocates for those rows."""
    s = from_config(_cfg())
    rows, cells = 4 * 2, 16 + 16
    assert gp.kv_cache_bytes(s) == rows * cells * 4 * 2 * 2 * 16 * 4
    cache = KVCache(4, rows, cells, 2, 16)  # the engine's own cache for the same rows and cells
    assert gp.kv_cache_bytes(s) == sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert gp.kv_prefill_bytes(s) == rows // 4 * 16 * 4 * 2 * 2 * 16 * 4  # one prompt cache a group of G = 4


def test_kv_cache_takes_the_embedding_dtype():
    """Half where O2 stores a frozen embedding in half (LoRA), fp32 where it trains (full at O2)."""
    assert gp.kv_dtype_bytes(from_config(_cfg("lora", "O2"))) == 2
    assert gp.kv_dtype_bytes(from_config(_cfg("full", "O2"))) == 4
    assert gp.kv_dtype_bytes(from_config(_cfg("full", "O3"))) == 2


def test_reference_copy_full_beta_only():
    """beta > 0 under full fine-tuning adds the frozen copy (as DPO's, in every phase); beta 0 none; LoRA none."""
    full0, full1 = (breakdown(from_config(_cfg(beta=b))) for b in (0.0, 0.04))
    ref = dict(full1.other_parts).get(REFERENCE, 0)
    assert ref == full1.params  # a whole fp32 copy of the fp32 trained weights at O0
    assert REFERENCE not in dict(full0.other_parts)
    assert full1.total - full0.total == ref
    lora0, lora1 = (breakdown(from_config(_cfg("lora", beta=b))) for b in (0.0, 0.04))
    assert REFERENCE not in dict(lora1.other_parts) and lora1.total == lora0.total


def test_peak_phase_switches_to_rollout_when_a_rank_samples_many_completions():
    """A rank samples micro_batch_size × accumulation completions (prompts × G) at once but trains on
    micro_batch_size at a time: few of them, the training step is the peak; many (long), sampling is."""
    short = breakdown(from_config(_cfg(micro=4, accum=1)))
    assert short.phase != ROLLOUT
    s = from_config(_cfg(micro=1, accum=96, num_generations=8, max_completion_length=64))
    long = breakdown(s)
    assert long.phase == ROLLOUT
    parts = dict(long.activation_parts)
    assert parts == {gp.KV_CACHE: gp.kv_cache_bytes(s), gp.KV_PREFILL: gp.kv_prefill_bytes(s)}
    assert long.activations == gp.kv_cache_bytes(s) + gp.kv_prefill_bytes(s)
    assert long.logits == gp.sampling_logits_bytes(s) == 96 * 512 * (4 + 4 * 4)  # O0: the step's, 4 fp32 beside
    assert long.grads == 0  # set_to_none: no gradients while sampling (one process)


def test_sampling_time_is_reported_and_grows_with_completion_length():
    dev = CATALOG["h100-80g"]
    short, long = (timing(from_config(_cfg(max_completion_length=n)), dev) for n in (16, 160))
    assert 0 < short.feature_s(gp.SAMPLING_KEY) < long.feature_s(gp.SAMPLING_KEY)
    once = timing(from_config(_cfg(num_iterations=1)), dev).feature_s(gp.SAMPLING_KEY)
    twice = timing(from_config(_cfg(num_iterations=2)), dev).feature_s(gp.SAMPLING_KEY)
    assert twice == pytest.approx(once / 2)  # one generation batch serves num_iterations steps


def test_guide_24gb_config_counts_the_rollout_and_fits_rtx4090():
    cfg = load_config(ROOT / "configs/guide-7b-lora-grpo-24gb.yaml")
    out = plan(cfg, CATALOG["rtx4090"])
    g = out["finetune"]["grpo"]
    assert g["kv_cache_bytes"] == 16 * 1024 * 32 * 2 * 4096 * 2  # 16 rows (2 prompts × G 8) of 1024 half cells
    assert g["reference_bytes"] == 0  # LoRA: the adapters switched off
    assert out["peak_phase"] == ROLLOUT
    assert out["time_breakdown_s"][gp.SAMPLING_KEY] > 0
    assert out["fits_device"], out.get("diagnosis")
    assert "notes" not in out or not any("not counted" in n for n in out["notes"])


@pytest.mark.slow  # MemTracker follows every decoding step (about a minute on 2 cores)
def test_planned_rollout_peak_matches_the_sampler_measured():
    """The real sampler (fitlm.step.sampler.sample, SlotBatch's cache) under MemTracker, every completion run to
    max_completion_length (no stop token): its peak live bytes against the plan's rollout moment less the
    optimizer states (none here), within 5% (the KV cache dominates)."""
    cfg = _cfg(micro=1, accum=96, num_generations=8, max_completion_length=64)
    s, g = from_config(cfg), cfg.finetune.grpo
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    prompts = [[1 + (i * 7 + j) % 500 for j in range(g.max_prompt_length)] for i in range(96 // 8)]
    seeds = list(range(len(prompts)))
    measured = peak_live_bytes(lambda: sample(model, prompts, g, (), seeds), [model], None, warmup_steps=0)
    planned = breakdown(s)
    assert planned.phase == ROLLOUT
    ratio = (planned.total - planned.optimizer) / measured["total"]
    print(f"planned / measured rollout peak: {ratio:.3f}")
    assert ratio == pytest.approx(1.0, abs=0.05)


def test_two_prompts_per_step_on_24gb_is_diagnosed_with_fewer_completions():
    """The guide's config at 4 prompts × G 8 per step: the rollout (its KV cache) does not fit the rtx4090, and the
    diagnosis offers halving the accumulation, which does."""
    cfg = load_config(ROOT / "configs/guide-7b-lora-grpo-24gb.yaml", overrides=["train.gradient_accumulation_steps=8"])
    out = plan(cfg, CATALOG["rtx4090"])
    assert out["peak_phase"] == ROLLOUT and not out["fits_device"]
    assert out["diagnosis"]["dominant"] == "activations"
    fixes = {r["change"]: r for r in out["diagnosis"]["remedies"]}
    half = next(k for k in fixes if k.startswith("train.gradient_accumulation_steps: 4"))
    assert fixes[half]["fits"], fixes


@pytest.mark.process
def test_plan_cli_names_the_rollout_phase(tmp_path):
    """The user's path: `fitlm plan CONFIG --device rtx4090` prints the rollout's parts and its peak moment; --json
    carries finetune.grpo and time_breakdown_s.grpo_sampling."""
    config = ROOT / "configs/guide-7b-lora-grpo-24gb.yaml"
    shown = fitlm("plan", config, "--device", "rtx4090", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert gp.KV_CACHE in shown.stderr and "GRPO's rollout (sampling)" in shown.stderr
    js = fitlm("plan", config, "--device", "rtx4090", "--json", cwd=tmp_path)
    out = json.loads(js.stdout)
    assert out["peak_phase"] == ROLLOUT and out["fits_device"]
    assert out["finetune"]["grpo"]["kv_cache_bytes"] == dict(out["activation_parts"])[gp.KV_CACHE]
    assert out["time_breakdown_s"][gp.SAMPLING_KEY] > 0
