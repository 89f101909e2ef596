"""The shipped configs/tiny.yaml on the demo data (tests/e2e/conftest.py: built with the commands `make demo` runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e.helpers import fitlm, read_metrics

GOLDEN = Path(__file__).parent / "golden" / "tiny_config_20_steps.json"


def train_tiny(root: Path, out: str, *overrides: str):
    return fitlm(
        "train",
        ROOT / "configs" / "tiny.yaml",
        "--json",
        "--set",
        f"data.train={root / 'data' / 'train'}",
        "--set",
        f"data.valid={root / 'data' / 'valid'}",
        "--set",
        f"train.output_dir={root / out}",
        "--set",
        "train.progress=false",
        *[x for o in overrides for x in ("--set", o)],
    )


def test_golden_losses_of_the_shipped_tiny_config(demo_data):
    # Steps 1-20 lie inside the 30 warmup steps, so max_steps=20 leaves their learning rates unchanged.
    proc = train_tiny(demo_data, "golden", "train.max_steps=20", "train.log_interval=1", "train.eval_interval=0")
    assert proc.returncode == 0, proc.stderr
    losses = [r["loss"] for r in read_metrics(demo_data / "golden")]
    if os.environ.get("FITLM_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    assert losses == pytest.approx(json.loads(GOLDEN.read_text())["losses"], rel=2e-4, abs=2e-4)


@pytest.mark.slow
def test_the_full_demo_run_learns(demo_data):
    proc = train_tiny(demo_data, "full")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["last_loss"] < summary["first_loss"] - 2.5 and summary["eval_loss"] < 5.3
    gen = fitlm("generate", demo_data / "full", "--prompt", "KING LEAR.", "--max-new-tokens", "40", "--json")
    assert gen.returncode == 0 and len(json.loads(gen.stdout)["token_ids"]) > 5
