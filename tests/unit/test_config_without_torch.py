"""Validating a config needs no model code: loading a YAML imports no torch (the family specs are torch-free)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import fitlm.config
cfg = fitlm.config.load_config({path!r})
cfg.model.ffn_size, [cfg.model.layer_type(i) for i in range(cfg.model.num_layers)]  # the spec's defaults
heavy = sorted(m for m in ("torch", "safetensors", "numpy") if m in sys.modules)
assert not heavy, f"validating {path} imported {{heavy}}"
"""


@pytest.mark.process
@pytest.mark.parametrize(
    "config",
    [
        "configs/tiny.yaml",  # dense llama
        "configs/qwen3-30b-a3b-lora-8x80gb.yaml",  # MoE: expert parallel, the family's routing checks
        "configs/mixtral-8x7b-16x80gb.yaml",
    ],
)
def test_validating_a_config_imports_no_torch(config):
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(path=config)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.process
def test_an_unknown_arch_is_reported_without_torch():
    code = (
        "import sys, fitlm.config\n"
        "try:\n    fitlm.config.validate_dict({'model': {'arch': 'nope'}})\n"
        "except fitlm.config.ConfigError as e:\n    assert 'model.arch: unknown family' in str(e), e\n"
        "assert 'torch' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
