"""A collective whose two sides disagree aborts a rank inside gloo's C++ (no Python error, torchrun says only
"Signal 6"); the launcher's report names the collective, the tensor and the mesh dimension it died in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from fitlm.parallel.collective_trace import TRACE_ENV, read_reports
from fitlm.parallel.launch import report_collectives

# Rank 0 sends a [512, 64] gradient where rank 1 expects its [256, 64] half: the mismatch of issue 35.
SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from fitlm.parallel.collective_trace import collective
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(512 if rank == 0 else 256, 64)
    with collective("all-reduce", "a warm-up value", "dp", torch.ones(1)):
        dist.all_reduce(torch.ones(1))  # matched: its record ends as done
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.empty_like(t), peer)]
    with collective("send/recv", "the tied embedding gradient model.embed_tokens.weight", "pp", t, f"pp rank {peer}"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    dist.destroy_process_group()
""")


def test_aborted_rank_is_reported_with_its_collective_tensor_and_mesh_dim(tmp_path, capsys):
    script = tmp_path / "mismatch.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "trace"
    trace.mkdir()
    env = dict(os.environ, **{TRACE_ENV: str(trace)}, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = read_reports(trace, 2)
    assert lines, proc.stderr[-3000:]
    assert all("send/recv of the tied embedding gradient model.embed_tokens.weight" in line for line in lines)
    assert all("over mesh dimension pp" in line for line in lines)
    # The receiver of the longer message aborts; its record has its own (smaller) buffer and names the peer.
    assert any(
        "rank 1 was inside" in line and "local [256, 64] float32, 65536 bytes" in line and "with pp rank 0" in line
        for line in lines
    ), lines
    assert not any("warm-up" in line for line in lines)  # a finished collective is not reported
    report_collectives(str(trace), 2, proc.returncode)
    err = capsys.readouterr().err
    assert "inside a collective" in err and "mesh dimension pp" in err
    assert trace.exists()  # kept for the stacks it names


def test_clean_exit_reports_nothing_and_removes_the_trace(tmp_path, capsys):
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "rank0.json").write_text('{"op": "all-reduce", "what": "x", "dim": "dp", "inside": false}')
    report_collectives(str(trace), 1, 1)
    assert capsys.readouterr().err == "" and not trace.exists()
