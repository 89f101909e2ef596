"""Frozen vocabulary tables under ZeRO-2/3 (fitlm.parallel.streamed_vocab): the full table's results, without
ever holding it.

A 2-rank gloo world checks, with an uneven row split (37 rows over 2 ranks) and pieces smaller than a rank's rows:
the head's logits and the input's gradient against F.linear on the full weight, in fp32 and under bf16
autocast; the embedding's rows against F.embedding, and its error for an id outside the table; and the host
memory a forward + backward of a 128 MiB head adds (one piece, not the head).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed.spawn import run_world

MiB = 2**20


def _equal_to_full_linear(mesh) -> dict:
    import fitlm.parallel.streamed_vocab as sh

    torch.manual_seed(0)  # every rank draws the same full weight and input
    full = torch.randn(37, 16)
    h = torch.randn(2, 5, 16)
    g = torch.randn(2, 5, 37)
    piece, sh.PIECE_BYTES = sh.PIECE_BYTES, 6 * 16 * 4  # 6-row pieces: 4 per rank, the last ones short
    try:
        out = {}
        for name, autocast in (("fp32", False), ("bf16", True)):
            head = nn.Linear(16, 37, bias=False)
            head.weight = nn.Parameter(full.clone(), requires_grad=False)
            sh.apply_streamed_tables([head], mesh)
            local = head.weight.to_local()
            x, ref_x = h.clone().requires_grad_(), h.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                got, want = head(x), F.linear(ref_x, full)
            got.backward(g)
            want.backward(g)
            out[name] = {
                "rows": local.shape[0],
                "dtype": [str(got.dtype), str(want.dtype)],
                "logits": (got.float() - want.float()).abs().max().item(),
                "logit_scale": want.float().abs().max().item(),
                "grad": (x.grad - ref_x.grad).abs().max().item(),
                "grad_scale": ref_x.grad.abs().max().item(),
            }
        embed = nn.Embedding(37, 16).requires_grad_(False)
        embed.weight.copy_(full)
        sh.apply_streamed_tables([embed], mesh)
        ids = torch.tensor([[0, 36, 18, 19], [5, 5, 30, 12]])  # both ranks' rows, the split's edge, repeats
        out["embedding"] = bool(torch.equal(embed(ids), F.embedding(ids, full)))
        try:
            embed(torch.tensor([[3, 37]]))
            out["bad_id"] = None
        except IndexError as e:
            out["bad_id"] = str(e)
        return out
    finally:
        sh.PIECE_BYTES = piece


def _memory_growth(mesh) -> dict:
    """VmHWM growth over a forward + backward of a [32768, 1024] fp32 head (128 MiB; 64 MiB per rank)."""
    from fitlm.hardware import host_peak_rss, reset_host_peak
    from fitlm.parallel.streamed_vocab import apply_streamed_tables

    head = nn.Linear(1024, 32768, bias=False, device="meta").requires_grad_(False)
    apply_streamed_tables([head], mesh)
    head.to_empty(device="cpu")
    head.weight.to_local().normal_()
    x = torch.randn(1, 4, 1024, requires_grad=True)
    dist.barrier()
    reset_host_peak()
    before = host_peak_rss()
    head(x).sum().backward()
    return {"growth": host_peak_rss() - before, "full": 32768 * 1024 * 4, "grad_finite": bool(x.grad.isfinite().all())}


def worker(rank: int, world: int, port: int, cases, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from fitlm.parallel.mesh import exit_process

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    out = {"equal": _equal_to_full_linear(mesh), "memory": _memory_growth(mesh)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    exit_process(0)


def test_streamed_tables_equal_the_full_ones_and_hold_one_piece(tmp_path):
    ranks = run_world(worker, __name__, 2, None, tmp_path, timeout=180, what="streamed vocabulary tables")
    assert [r["equal"]["fp32"]["rows"] for r in ranks] == [19, 18]  # torch.chunk's split of 37 rows
    for r in ranks:
        fp32, bf16 = r["equal"]["fp32"], r["equal"]["bf16"]
        assert fp32["dtype"] == ["torch.float32"] * 2 and bf16["dtype"] == ["torch.bfloat16"] * 2
        assert fp32["logits"] < 1e-6 * fp32["logit_scale"]  # the same dot products, the GEMM blocked otherwise
        assert fp32["grad"] < 1e-5 * fp32["grad_scale"]  # the pieces' partial sums in another order
        assert bf16["logits"] < 1e-2 * bf16["logit_scale"]  # within bf16 rounding of one logit
        assert bf16["grad"] < 2e-2 * bf16["grad_scale"]  # bf16 pieces summed in fp32 vs one bf16 GEMM
        assert r["equal"]["embedding"]
        assert "token id 37 is outside the embedding's 37 rows" in r["equal"]["bad_id"]
        mem = r["memory"]
        assert mem["grad_finite"]
        # One 32 MiB piece in flight (FSDP2's gather held the 128 MiB head and its copy-out: 256 MiB).
        assert mem["growth"] < 0.4 * mem["full"], f"grew {mem['growth'] // MiB} MiB for a {mem['full'] // MiB} MiB head"
