"""`fitlm profile` under a 2-rank layout (torchrun, gloo): every rank measured and gathered to rank 0,
communication seen, the report, plots and JSON as in one process."""

from __future__ import annotations

import json

from tests.e2e.helpers import fitlm, tiny_config, write_config
from tests.unit.test_profile import check_report


def test_two_rank_profile_gathers_every_rank(tiny_corpus, tmp_path):
    cfg = tiny_config(
        tiny_corpus,
        tmp_path / "run",
        parallel={"data_parallel": 2, "zero_stage": 1},
        train={"micro_batch_size": 2, "gradient_accumulation_steps": 1},
    )
    out = tmp_path / "out"
    # --nproc as a user types it: the relaunch under torchrun must not pass it on (torchrun would refuse it)
    proc = fitlm(
        "profile", write_config(tmp_path / "cfg.yaml", cfg), "--steps", "2", "--out", out, "--json", "--nproc", "2"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(proc.stdout.strip().splitlines()) == 1  # rank 0 alone prints, once
    result = json.loads(proc.stdout)
    check_report(out, result, world=2)
    assert result["world_size"] == 2 and result["tokens_per_step"] == 2 * 64 * 2
    assert [r["dp_rank"] for r in result["per_rank"]] == [0, 1]
    # DDP all-reduces the gradients and ZeRO-1 broadcasts the updated parameters: the profiler sees gloo
    assert all(r["comm"]["comm_s"] > 0 for r in result["per_rank"])
    assert any(k.startswith("gloo:") for k in result["per_rank"][0]["comm"]["comm_ops"])
    assert "per_device" in result["plan"]["simulated"]  # DDP + ZeRO-1, simulated on the fake process group
    assert abs(result["errors"]["simulated"]["total"]) <= 0.03, result["errors"]
    assert "| 1 | 1/0/0 |" in (out / "report.md").read_text()  # rank 1's row
