"""Host memory in plans (fitlm.plan.host): per rank at load, step and save, per node against the host's RAM.

Expected values are computed here from the model's shape and the documented formulas, never by calling the
planner's own functions for them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fitlm.config import validate_dict
from fitlm.plan.devices import CATALOG, GiB
from fitlm.plan.report import plan
from tests.e2e.helpers import write_config

H, F, V, L = 4096, 11008, 32000, 32  # Llama 2 7B
LLAMA_7B = {
    "arch": "llama",
    "hidden_size": H,
    "num_layers": L,
    "num_heads": 32,
    "num_kv_heads": 32,
    "intermediate_size": F,
    "vocab_size": V,
    "max_seq_len": 4096,
}
BLOCK = 4 * H * H + 3 * H * F + 2 * H  # q, k, v, o; gate, up, down; two norms
TOP = V * H  # the embedding (or the head): the largest weight outside the blocks, gathered one by one
GROUP = max(BLOCK, TOP)  # what a save gathers at once, at most (7B: a block)
PARAMS = L * BLOCK + 2 * V * H + H


def _cfg(**sections):
    return validate_dict({"model": LLAMA_7B, "data": {"seq_length": 4096}, **sections})


def test_zero3_on_a100_nodes_load_and_save_follow_the_formulas():
    cfg = _cfg(parallel={"data_parallel": 16, "zero_stage": 3}, memory={"mixed_precision": "O2", "recompute": "full"})
    dev = CATALOG["a100-80g"]
    host = plan(cfg, dev, 16)["host"]
    runtime = dev.host_runtime_bytes
    # Seeded initialisation: one module at a time in fp32; the largest is the [V, H] embedding (or head), and fp32
    # is the training dtype already: no second copy. Nothing of the model lives on the host (GPU, no offload).
    assert host["per_rank"]["load"] == runtime + V * H * 4
    assert host["per_rank"]["step"] == runtime
    # Save: rank 0 holds the largest group (a block > the [V, H] embedding) gathered and converted, in fp32.
    assert BLOCK > TOP
    assert host["per_rank"]["save"] == runtime + 2 * GROUP * 4
    assert host["per_rank"]["save_other_ranks"] == runtime + GROUP * 4  # sharded: every rank gathers
    # Two 8-GPU nodes: a node holds 8 ranks; at save rank 0 and 7 others.
    assert host["ranks_per_node"] == 8
    assert host["per_node"]["load"] == 8 * (runtime + V * H * 4)
    assert host["per_node"]["save"] == runtime + 2 * GROUP * 4 + 7 * (runtime + GROUP * 4)
    assert host["ram_bytes"] == 2 * 10**12 and host["fits"] is True


def test_loading_a_bf16_checkpoint_reads_the_largest_tensor_and_its_fp32_copy(tmp_path):
    # A real safetensors header: the planner reads the dtypes and shapes, not the data.
    tiny = {
        "arch": "llama",
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 176,
        "vocab_size": 512,
        "max_seq_len": 64,
    }
    from fitlm.models.hf import save_hf_dir
    from fitlm.registry import build_model

    model_cfg = validate_dict({"model": tiny, "data": {"seq_length": 64}}).model
    save_hf_dir(build_model(model_cfg).to(torch.bfloat16), model_cfg, tmp_path / "hf")
    cfg = validate_dict({"model": {**tiny, "init_from": str(tmp_path / "hf")}, "data": {"seq_length": 64}})
    host = plan(cfg, CATALOG["h100-80g"], 1)["host"]
    # the largest source tensor: embed_tokens / lm_head [512, 64], bf16 in the file, fp32 in training
    assert host["source_tensor"]["numel"] == 512 * 64 and host["source_tensor"]["file_bytes_per_element"] == 2
    assert host["per_rank"]["load"] == CATALOG["h100-80g"].host_runtime_bytes + 512 * 64 * (2 + 4)


def test_cpu_training_keeps_the_whole_training_state_on_the_host():
    from fitlm.plan.devices import get_device

    cfg = _cfg(memory={"mixed_precision": "O0"}, train={"micro_batch_size": 1})
    dev = get_device("cpu")
    out = plan(cfg, dev, 1)
    host, total = out["host"], out["per_device"]
    assert host["per_rank"]["load"] == dev.host_runtime_bytes + PARAMS * 4 + V * H * 4  # share + one fp32 module
    assert host["per_rank"]["step"] == dev.host_runtime_bytes + total["total"]
    # after the last step gradients and AdamW's moments are released: the parameters, plus the gathered group twice
    assert host["per_rank"]["save"] == dev.host_runtime_bytes + PARAMS * 4 + 2 * GROUP * 4


def test_offloaded_zero3_shards_are_on_the_host_from_load_on():
    cfg = _cfg(
        parallel={"data_parallel": 8, "zero_stage": 3},
        memory={"mixed_precision": "O2", "cpu_offload": True, "recompute": "full"},
    )
    dev = CATALOG["h100-80g"]
    host = plan(cfg, dev, 8)["host"]
    shard = PARAMS * 4 / 8  # FSDP2's CPU offload: this rank's fp32 parameter shard ...
    assert host["per_rank"]["load"] == pytest.approx(dev.host_runtime_bytes + shard + V * H * 4, abs=8)
    # ... and, while training, its gradient and both AdamW moments too: 16 bytes per parameter over 8 ranks
    assert host["per_rank"]["step"] == pytest.approx(dev.host_runtime_bytes + PARAMS * 16 / 8, abs=32)


def test_a_plan_the_host_cannot_hold_says_so(tmp_path, capsys):
    from fitlm.cli import main

    path = write_config(
        tmp_path / "c.yaml",
        {
            "model": LLAMA_7B,
            "data": {"seq_length": 4096},
            "parallel": {"data_parallel": 8, "zero_stage": 3},
            "memory": {"mixed_precision": "O2", "cpu_offload": True, "recompute": "full"},
        },
    )
    args = ["plan", str(path), "--device", "h100-80g", "--num-devices", "8", "--host-memory", "64GB"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 8 ranks x (runtime + 16 bytes per parameter / 8) is far above 90% of 64 GB
    assert out["fits_device"] is True and out["host"]["fits"] is False and out["fits"] is False
    assert out["host"]["over_by_bytes"] == max(out["host"]["per_node"].values()) - int(0.9 * 64 * 10**9)
    assert main(args) == 0
    assert "warning: host memory" in capsys.readouterr().err
    big = main(args[:-1] + ["2TB", "--json"])
    assert big == 0 and json.loads(capsys.readouterr().out)["host"]["fits"] is True


def test_search_proposes_no_layout_the_host_cannot_hold():
    from fitlm.plan.search import candidates

    cfg = _cfg(train={"micro_batch_size": 1, "gradient_accumulation_steps": 8})
    dev = replace(CATALOG["rtx4090"], host_memory_bytes=512 * 10**9)
    found = candidates(cfg, 4, dev)
    # 7B full training on 4 x 24 GB only fits with the states offloaded to the host ...
    assert found and all(c.setup.offload for c in found)
    assert all(c.host.worst[1] <= 0.9 * 512 * 10**9 for c in found)
    # ... which a 64 GB host cannot hold: 4 ranks x 16 bytes per parameter / 4 is ~108 GB
    assert not candidates(cfg, 4, replace(dev, host_memory_bytes=64 * 10**9))
    assert 4 * 3 * GiB + PARAMS * 16 > 0.9 * 64 * 10**9


def test_host_memory_flag_is_a_size():
    from fitlm.plan.devices import DeviceError, get_device

    assert get_device("rtx4090", host_memory="512GiB").host_memory_bytes == 512 * 2**30
    with pytest.raises(DeviceError, match="--host-memory 'lots'"):
        get_device("rtx4090", host_memory="lots")
