"""`fitlm plan` says what its figures are for: which device and why (the report's first line, `device_source` in the
JSON), and at which moment its rows are counted. The GPU branch is exercised with the detection passed in (a
LocalGPU as torch.cuda would describe it); the CPU machine's branch runs for real through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fitlm.cli import main
from fitlm.plan.device_choice import LocalGPU, choose_device
from fitlm.plan.devices import CATALOG, GiB

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
H100 = LocalGPU("NVIDIA H100 80GB HBM3", 85_024_112_640)


def no_gpu() -> None:
    return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU default: on a GPU machine the GPU is chosen")
def test_without_a_gpu_the_default_is_named_with_the_flag_that_changes_it(capsys):
    assert main(["plan", TINY, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert next(iter(result)) == "device_source" and result["device"]["name"] == "a100-80g"  # old keys kept
    assert result["device_source"] == {
        "by": "default",
        "note": "planned for a100-80g (default: no --device given and no GPU here; pass --device cpu or --device NAME)",
    }
    assert main(["plan", TINY]) == 0
    assert capsys.readouterr().err.splitlines()[0] == result["device_source"]["note"]  # the table's first line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_machine_the_default_is_that_gpu(capsys):
    assert main(["plan", TINY, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device_source"]["by"] == "local_gpu"
    assert torch.cuda.get_device_name(0) in result["device_source"]["note"]


def test_a_flag_and_the_config_are_named(capsys):
    assert main(["plan", TINY, "--device", "rtx4090", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_source"] == {
        "by": "flag",
        "note": "planned for rtx4090 (--device rtx4090)",
    }
    dev, source = choose_device(config_device="cpu", detect=lambda: H100)  # the config's cpu beats the GPU
    assert dev.name == "cpu" and source["by"] == "config" and "train.device: cpu" in source["note"]
    dev, source = choose_device(memory="48GiB", tflops=200.0, detect=lambda: H100)
    assert dev.name == "custom" and source["note"].startswith("planned for custom (--device-memory and")


def test_this_machines_gpu_is_its_catalog_entry_or_its_own_figures():
    dev, source = choose_device(detect=lambda: H100)
    assert dev == CATALOG["h100-80g"] and source["by"] == "local_gpu"
    assert "NVIDIA H100 80GB HBM3, 79 GiB, its catalog entry; --device h100-80g" in source["note"]
    assert choose_device(detect=lambda: LocalGPU("NVIDIA A100-SXM4-40GB", 40 * GiB))[0].name == "a100-40g"
    assert choose_device(detect=lambda: LocalGPU("NVIDIA A100-SXM4-80GB", 80 * GiB))[0].name == "a100-80g"
    assert choose_device("rtx3090", detect=lambda: H100)[0].name == "rtx3090"  # --device beats the GPU
    # Not in the catalog: its own name and memory, the datasheet peak fitlm.hardware knows.
    dev, source = choose_device(efficiency=0.3, detect=lambda: LocalGPU("NVIDIA L40S", 48 * GiB))
    assert (dev.name, dev.memory_bytes, dev.tflops, dev.efficiency) == ("NVIDIA L40S", 48 * GiB, 362.0, 0.3)
    assert "not in the catalog" in source["note"] and source["note"].endswith("--efficiency from the command line)")


def test_a_config_asking_for_cuda_on_a_machine_without_one_says_so():
    dev, source = choose_device(config_device="cuda", detect=no_gpu)
    assert dev.name == "a100-80g" and source["by"] == "default"
    assert "train.device: cuda but no GPU here; pass --device cpu or --device NAME" in source["note"]


def test_the_rows_are_said_to_be_at_the_peak_moment(capsys):
    """A full-training plan peaking in forward/backward has no gradients at that moment: the report says its rows
    are the peak moment's, and which moment, so `grads 0.00 GiB` does not read as a bug."""
    assert main(["plan", TINY, "--device", "a100-80g", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["finetune"]["method"] == "full" and result["per_device"]["grads"] == 0
    assert result["peak_phase"] == "forward/backward"
    assert main(["plan", TINY, "--device", "a100-80g"]) == 0
    err = " ".join(capsys.readouterr().err.split())  # (rich wraps long lines)
    assert "per device, at the peak moment" in err
    assert (
        "each row is at the peak moment, forward/backward: the loss or the first recomputed block, before this" in err
    )
