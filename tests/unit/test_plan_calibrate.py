"""`fitlm plan --calibrate`: a measured `fitlm profile` burst sets the throughput model's efficiency, so the
plan of the profiled config reproduces the measured step time; bad profile files are named."""

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


def test_calibrated_plan_reproduces_the_measured_step_time(profiled, capsys):
    config, out, result = profiled
    timing = result["plan"]["timing"]
    rate, note = sustained_tflops(out)  # the directory or its profile.json
    assert rate == pytest.approx(timing["tflops"] * timing["efficiency"] * timing["step_time_s"] / result["step_time_s"])
    assert "measured step" in note
    assert main(["plan", str(config), "--device", "cpu", "--calibrate", str(out / "profile.json"), "--json"]) == 0
    captured = capsys.readouterr()
    planned = json.loads(captured.out)
    assert planned["device"]["efficiency"] == pytest.approx(min(1.0, rate / planned["device"]["tflops"]))
    assert "calibrated from" in planned["device"]["calibration"] and "calibrated from" in captured.err
    # One process, no communication: the plan's step is compute / sustained rate, i.e. the measured step.
    assert planned["step_time_s"] == pytest.approx(result["step_time_s"], rel=1e-6)


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
