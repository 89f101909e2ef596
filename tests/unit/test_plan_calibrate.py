"""`fitlm plan --calibrate`: a measured `fitlm profile` burst sets the throughput model's efficiency, so the
plans of the profiled config and of other configurations on that device follow the measured rate; bad
profile files are named. Whether the calibrated prediction matches a second measured profile is timing,
so it is a benchmark: bench/calibration.py."""

from __future__ import annotations

import json

import pytest

from fitlm.cli import main
from fitlm.plan.calibrate import CalibrationError, sustained_tflops
from tests.e2e.helpers import fitlm, tiny_config, write_config


@pytest.fixture(scope="module")
def profiled(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    path = write_config(root / "cfg.yaml", tiny_config(tiny_corpus, root / "run"))
    proc = fitlm("profile", path, "--steps", "3", "--out", root / "out", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return path, root / "out", json.loads(proc.stdout)


def plan_json(config, calibration, capsys, *sets: str) -> dict:
    args = ["plan", str(config), "--device", "cpu", "--calibrate", str(calibration), "--json"]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.process
def test_calibration_from_one_profile_predicts_another_configuration(profiled, capsys):
    config, out, result = profiled
    planned = plan_json(config, out / "profile.json", capsys)
    assert "calibrated from" in planned["device"]["calibration"]
    # The profiled config itself: one process, no communication, so the plan's step is the measured one.
    assert planned["step_time_s"] == pytest.approx(result["step_time_s"], rel=1e-6)
    # Another configuration, never profiled: twice the micro batches per step (accumulation 4 instead of 2)
    # and a recomputed model. With the sustained rate fixed by the profile, the prediction follows the work:
    # twice the tokens, and full recompute adds one forward of the blocks (2 of the 6 FLOPs per weight).
    other = plan_json(config, out / "profile.json", capsys, "train.gradient_accumulation_steps=4")
    assert other["step_time_s"] == pytest.approx(2 * result["step_time_s"], rel=1e-6)
    recomputed = plan_json(config, out / "profile.json", capsys, "memory.recompute=full")
    assert result["step_time_s"] < recomputed["step_time_s"] < 1.5 * result["step_time_s"]


@pytest.mark.process
def test_bad_calibration_inputs_are_named(profiled, tmp_path):
    config = profiled[0]
    with pytest.raises(CalibrationError, match="no such file"):
        sustained_tflops(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(CalibrationError, match="not a JSON file"):
        sustained_tflops(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(CalibrationError, match="re-run `fitlm profile`"):
        sustained_tflops(tmp_path / "empty.json")
    r = fitlm("plan", config, "--device", "cpu", "--calibrate", profiled[1], "--efficiency", "0.3")
    assert r.returncode != 0 and "give one of them" in r.stderr
