"""The peak MFU is measured against: a busy machine's low GEMM reading never lowers it, and MFU above
100% is reported with a warning naming train.peak_tflops."""

from __future__ import annotations

import json

import torch

from fitlm import hardware
from fitlm.config import validate_dict
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import read_metrics, tiny_config


def test_the_cached_peak_only_rises(tmp_path, monkeypatch):
    monkeypatch.setenv("FITLM_CACHE_DIR", str(tmp_path))
    assert hardware.remember_peak("cpu:bf16", 4e11) == 4e11  # first measurement: kept
    assert hardware.remember_peak("cpu:bf16", 1.4e9) == 4e11  # a busy machine's reading does not lower it
    assert hardware.remember_peak("cpu:bf16", 5e11) == 5e11  # a better one raises it
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cached.values()) == [5e11]
    assert "cpu:bf16" in next(iter(cached)) and f"threads={torch.get_num_threads()}" in next(iter(cached))
    assert hardware.remember_peak("cpu:fp32", 1e9) == 1e9  # another dtype has its own entry


def test_a_damaged_cache_costs_only_its_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("FITLM_CACHE_DIR", str(tmp_path))
    (tmp_path / "peak_flops.json").write_text("{not json")
    assert hardware.remember_peak("cpu:bf16", 2e9) == 2e9
    assert hardware.remember_peak("cpu:bf16", 1e9) == 2e9  # rewritten whole, and used


def test_device_peak_uses_the_cached_best_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FITLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_gemm_flops", lambda device, dtype: 1e9)  # a loaded machine
    hardware.remember_peak(f"cpu:{torch.bfloat16}", 3e11)  # what an idle moment measured earlier
    assert hardware.device_peak_flops(torch.device("cpu"), torch.bfloat16) == 3e11
    assert hardware.device_peak_flops(torch.device("cpu"), torch.bfloat16, override_tflops=2.0) == 2e12


def test_mfu_above_one_is_told_with_the_fix():
    assert hardware.mfu_warning(0.99, torch.device("cpu")) is None
    text = hardware.mfu_warning(1.52, torch.device("cpu"))
    assert "152%" in text and "train.peak_tflops" in text and "busy" in text


def test_training_warns_once_when_mfu_reads_above_peak(tiny_corpus, tmp_path):
    # A pinned peak far below what any CPU does: MFU reads far above 100%.
    cfg = tiny_config(tiny_corpus, tmp_path / "out", train={"max_steps": 3, "eval_interval": 0, "peak_tflops": 1e-9})
    Trainer(validate_dict(cfg)).fit()
    records = read_metrics(tmp_path / "out")
    assert all(r["mfu"] > 1 for r in records if "loss" in r)
    warned = [r for r in records if r.get("warning") == "mfu_above_peak"]
    assert len(warned) == 1 and "train.peak_tflops" in warned[0]["message"], warned
