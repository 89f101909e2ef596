"""`fitlm profile` in one process: the report's tables, plots that open as images, the blueprint's JSON,
and every bad input refused before anything runs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.helpers import fitlm, tiny_config, write_config

BLUEPRINT_KEYS = {"per_device", "tokens_per_s", "mfu", "peak_bytes"}
COMPONENTS = {"params", "grads", "optimizer", "activations", "logits", "other", "total"}
TABLES = (
    "## Summary",
    "## Per rank",
    "## Memory: measured vs planned",
    "## Step time",
    "## Where the memory goes: top modules",
    "## Where the memory goes: top operators",
)
PLOTS = ("memory.png", "step_time.png", "burst.png")


def check_report(out, result: dict, world: int) -> None:
    """What every profile must hold: the blueprint's keys, one entry per rank, the tables, three real images."""
    from PIL import Image

    assert BLUEPRINT_KEYS <= result.keys()
    assert set(result["per_device"]) == COMPONENTS
    assert result["peak_bytes"] == max(r["memory"]["total"] for r in result["per_rank"])
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert [r["rank"] for r in result["per_rank"]] == list(range(world))
    assert {"forward", "backward", "optimizer", "data"} <= result["step_seconds"].keys()
    assert result["errors"]["analytic"]["total"] is not None
    report = (out / "report.md").read_text()
    for title in TABLES:
        assert title in report, title
    assert json.loads((out / "profile.json").read_text())["per_device"] == result["per_device"]
    for name in PLOTS:
        with Image.open(out / name) as img:
            img.verify()
        with Image.open(out / name) as img:
            assert img.format == "PNG" and img.size[0] >= 400 and img.size[1] >= 150, (name, img.size)
        assert f"]({name})" in report
    assert not (out / "burst").exists()  # the scratch training directory is removed


@pytest.fixture(scope="module")
def single(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    cfg = tiny_config(tiny_corpus, root / "run", train={"gradient_accumulation_steps": 2})
    path = write_config(root / "cfg.yaml", cfg)
    proc = fitlm("profile", path, "--steps", "3", "--out", root / "out", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "config": path, "out": root / "out", "proc": proc, "result": json.loads(proc.stdout)}


@pytest.mark.process
def test_single_process_profile_writes_report_plots_and_json(single):
    proc, result = single["proc"], single["result"]
    assert len(proc.stdout.strip().splitlines()) == 1  # exactly one JSON object on stdout; progress on stderr
    assert "profile: step 3/3, loss " in proc.stderr and ", ETA " in proc.stderr  # a line each log_interval (1)
    check_report(single["out"], result, world=1)
    assert len(result["history"]) == 3 and all(h["loss"] > 0 for h in result["history"])
    # accumulation 2: the root module runs twice in the measured step and is followed, not refused
    assert "memory_error" not in result
    # one process: the simulate engine runs the same step on fake tensors and agrees with the measurement
    assert abs(result["errors"]["simulated"]["total"]) <= 0.03
    assert not (single["root"] / "run").exists()  # train.output_dir is never touched


@pytest.mark.process
def test_out_dir_rules(single, tmp_path):
    cfg = single["config"]
    again = fitlm("profile", cfg, "--steps", "2", "--out", single["out"])
    assert again.returncode == 2 and "not empty" in again.stderr and "--force" in again.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    proc = fitlm("profile", cfg, "--steps", "2", "--out", foreign, "--force")
    assert proc.returncode == 2 and "holds no fitlm profile" in proc.stderr
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "args,message",
    [(["--steps", "1"], "--steps 1: at least 2"), (["--steps", "2", "--nproc", "2"], "but 2 processes run")],
)
@pytest.mark.process
def test_bad_arguments_are_refused_before_anything_runs(single, tmp_path, args, message):
    proc = fitlm("profile", single["config"], "--out", tmp_path / "p", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "p").exists()


@pytest.mark.process
def test_missing_config_is_named(tmp_path):
    proc = fitlm("profile", tmp_path / "nope.yaml")
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr and "does not exist" in proc.stderr


def test_tracker_follows_a_root_module_called_twice_in_one_step():
    """Gradient accumulation: MemTracker alone refuses a second root forward; track_step measures it."""
    from fitlm.memory.tracking import track_step

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 16)

    def step():
        for _ in range(2):
            model(x).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    mem = track_step(step, [model], opt)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert mem.peak["params"] == params and mem.peak["optimizer"] >= 2 * params
    rows = {r["module"]: r for r in mem.modules}
    assert rows["Sequential.0"]["params"] == 16 * 32 * 4 + 32 * 4
    assert rows["Sequential.0"]["forward_kept"] > 0


def test_relaunch_under_torchrun_drops_nproc():
    """torchrun reads `--nproc` anywhere on its command line as an ambiguous --nproc-per-node and refuses to start;
    the relaunched command (profile and train alike) must not carry it, and keeps everything else."""
    from fitlm.parallel.launch import torchrun_command

    cmd = torchrun_command(2, ["profile", "c.yaml", "--nproc", "2", "--set", "a=1", "--nproc=2", "--steps", "3"])
    assert "--nproc-per-node=2" in cmd and cmd[1:3] == ["-m", "fitlm.parallel.lifetime"]
    assert cmd[cmd.index("fitlm.cli") + 1 :] == ["profile", "c.yaml", "--set", "a=1", "--steps", "3"]
