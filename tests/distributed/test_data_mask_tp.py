"""Document masks under tensor (+ sequence) parallel: heads are sharded, the [B,1,T,T] mask broadcasts.

2 gloo ranks; each rank also computes the single-process reference. Logits and gradients of a
tensor-parallel forward/backward with document_ids equal the unsharded model's.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fitlm.config import ModelConfig
from fitlm.parallel.mesh import exit_process

V = 128
CASES = {"llama": dict(arch="llama", num_kv_heads=2), "gpt2": dict(arch="gpt2")}


def build(case: str) -> torch.nn.Module:
    from fitlm.registry import build_model

    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=V, max_seq_len=32, intermediate_size=128, **CASES[case]
    )
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    doc = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    return ids, doc


def run(case: str, sp: bool, mesh) -> dict:
    from fitlm.parallel.tensor_parallel import apply_tensor_parallel

    ids, doc = inputs()
    ref = build(case)
    want = ref(ids, document_ids=doc)
    want.square().mean().backward()
    model = apply_tensor_parallel(build(case), mesh, sequence_parallel=sp, loss_parallel=False)
    got = model(ids, document_ids=doc)
    got.square().mean().backward()
    q = model.model.layers["0"].self_attn.q_proj.weight
    grads = {
        k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for k, p in model.named_parameters()
    }
    ref_grads = dict(ref.named_parameters())
    return {
        "logit_diff": (got - want).abs().max().item(),
        "local_heads": q.to_local().shape[0] // 16,
        "grad_diff": max((g - ref_grads[k].grad).abs().max().item() for k, g in grads.items()),
        "unmasked_diff": (ref(ids) - want).abs().max().item(),
    }


def worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"]
    results = {}
    for case in CASES:
        for sp in (False, True):
            try:
                results[f"{case}-sp{int(sp)}"] = run(case, sp, mesh)
            except Exception:
                results[f"{case}-sp{int(sp)}"] = {"error": traceback.format_exc()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    exit_process(0)  # not a normal exit: see fitlm.parallel.mesh.exit_process


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tpmask") / "r.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("key", ["llama-sp0", "llama-sp1", "gpt2-sp0", "gpt2-sp1"])
def test_block_mask_under_tensor_parallel_matches_single_process(results, key):
    r = results[key]
    assert "error" not in r, r.get("error")
    assert r["local_heads"] == 2  # 4 heads, 2 per rank: the mask met sharded heads
    assert r["unmasked_diff"] > 1e-3  # the mask matters for this input
    assert r["logit_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r
