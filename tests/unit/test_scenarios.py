"""The guide's three scenarios as shipped configs (configs/guide-*.yaml), planned: planner only, nothing trained.

1. 7B LoRA on one 24 GB card (bf16, full recompute, micro batch 2 × accumulation 8): fits.
2. 7B on 4 × 24 GB: the guide's dp2 × tp2 × pp2 needs 8 devices and is refused with the arithmetic; `--search`
   writes the fastest layout that fits the cards and their host.
3. 7B LoRA on 8 × 64 GB (dp8): fitlm's plan beside the guide's 1.8 s/step, 52 GB peak, 14,564 tokens/s.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import yaml

from fitlm.config import load_config, validate_dict
from fitlm.plan.devices import CATALOG
from fitlm.plan.report import plan
from fitlm.plan.setup import from_config, total_params
from tests.unit.test_bench_smoke import bench_module

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_7b_lora_fits_one_24gb_card():
    cfg = load_config(CONFIGS / "guide-7b-lora-24gb.yaml")
    assert (cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps, cfg.memory.recompute) == (2, 8, "full")
    out = plan(cfg, CATALOG["rtx4090"], 1)
    assert out["fits"] is True and out["per_device"]["total"] <= CATALOG["rtx4090"].usable_bytes
    # It fits because O2 stores the frozen base in half: 2 bytes for each of its 6.7B parameters ...
    base = total_params(from_config(cfg))
    assert 6.6e9 < base < 6.8e9
    assert abs(out["per_device"]["params"] - (2 * base + 4 * out["finetune"]["adapter_params"])) < 2**20
    # ... and an fp32 base (O1 keeps fp32 weights) does not: 27 GB of weights alone.
    fp32 = plan(load_config(CONFIGS / "guide-7b-lora-24gb.yaml", ["memory.mixed_precision=O1"]), CATALOG["rtx4090"], 1)
    assert fp32["fits"] is False


def test_the_guides_4x24gb_layout_is_refused_with_the_arithmetic(capsys):
    from fitlm.cli import main

    assert main(["plan", str(CONFIGS / "guide-7b-4x24gb.yaml"), "--device", "rtx4090", "--num-devices", "4"]) == 2
    err = capsys.readouterr().err
    assert "2 × 2 × 2 = 8" in err and "but 4" in err
    assert all(key in err for key in ("data_parallel", "tensor_parallel", "pipeline_parallel"))


def test_search_writes_the_fastest_layout_that_fits_4x24gb(tmp_path, capsys):
    from fitlm.cli import main

    best = tmp_path / "best.yaml"
    assert (
        main(
            [
                "plan",
                str(CONFIGS / "guide-7b-4x24gb.yaml"),
                "--device",
                "rtx4090",
                "--num-devices",
                "4",
                "--search",
                "--json",
                "--best-out",
                str(best),
            ]
        )
        == 0
    )
    top = json.loads(capsys.readouterr().out)["search"]["top"]
    assert top and [c["tokens_per_s"] for c in top] == sorted((c["tokens_per_s"] for c in top), reverse=True)
    chosen = validate_dict(yaml.safe_load(best.read_text()))
    assert chosen.parallel.world_size == 4
    again = plan(chosen, CATALOG["rtx4090"], 4)  # the written config, planned on its own: it fits, device and host
    assert again["fits"] is True and again["host"]["fits"] is True
    assert again["tokens_per_s"] == top[0]["tokens_per_s"]
    # 16 bytes per parameter of model states (~108 GB) exceed the four cards (96 GB): the states must be offloaded,
    # and a 128 GB host cannot take them from four ranks: then no layout is proposed at all
    assert 16 * total_params(from_config(chosen)) > 4 * CATALOG["rtx4090"].memory_bytes and chosen.memory.cpu_offload
    small_host = replace(CATALOG["rtx4090"], host_memory_bytes=128 * 10**9)
    assert plan(load_config(CONFIGS / "guide-7b-4x24gb.yaml"), small_host, 4, search=True)["search"]["top"] == []


def test_8x64gb_lora_plan_beside_the_guides_numbers():
    table = bench_module("guide_scenarios").rows()
    row = next(r for r in table if r["plan"]["config"] == "configs/guide-7b-lora-8x64gb.yaml")
    guide, planned = row["guide"], row["plan"]
    assert planned["fits"] is True and planned["layout"].startswith("dp8×tp1×pp1")
    # The planned peak for the batch the config assumes (2 sequences of 4096 per device) against the guide's 52 GB
    assert abs(planned["peak_gb"] / guide["peak_gb"] - 1) < 0.10, planned
    md = bench_module("guide_scenarios").markdown(table)
    assert "52 GB peak" in md and "14,564 tokens/s" in md and f"{planned['tokens_per_s']:,.0f} tokens/s" in md
    refused = next(r for r in table if r["plan"]["config"] == "configs/guide-7b-4x24gb.yaml")["plan"]
    assert "2 × 2 × 2 = 8" in refused["refused"] and refused["search_best"]["layout"].replace(" ", "").count("×") == 2


def test_7b_lora_grpo_g8_fits_one_24gb_card():
    cfg = load_config(CONFIGS / "guide-7b-lora-grpo-24gb.yaml")
    g = cfg.finetune.grpo
    assert (cfg.finetune.objective, cfg.finetune.method, g.num_generations) == ("grpo", "lora", 8)
    out = plan(cfg, CATALOG["rtx4090"], 1)
    assert out["fits"] is True and out["per_device"]["total"] <= CATALOG["rtx4090"].usable_bytes
