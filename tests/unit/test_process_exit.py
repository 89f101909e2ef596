"""How a rank leaves: `exit_process` keeps the exit status and the buffered output, with a live process group.

A normal interpreter exit after gloo + FSDP can abort a finished rank (SIGABRT during finalization,
about one 2-rank run in twelve with torch 2.13), so ranks under torchrun leave through `exit_process`.
The abort itself is a race and cannot be forced in a test; what is tested is that leaving this way
loses neither the status nor what the rank printed, and that the CLI keeps its exit-status contract.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a real pipe is
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env={**base, **env}
    )


@pytest.mark.process
def test_exit_process_keeps_status_and_buffered_output_with_a_live_group(tmp_path):
    proc = python(f"""
        import sys, torch, torch.distributed as dist
        from fitlm.parallel.mesh import exit_process
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        print("reduced", int(t.sum()), end="")   # stdout to a pipe is block-buffered: lost unless flushed
        sys.stderr.write("last words")
        exit_process(3)
        print("unreachable")
    """)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "reduced 3"
    assert proc.stderr.endswith("last words")


@pytest.mark.process
def test_cli_rank_keeps_exit_status_contract(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "fitlm.cli", "config", "docs"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **TORCHRUN_ENV},
    )
    assert ok.returncode == 0, ok.stderr
    assert "train.lr" in ok.stdout  # the whole reference reached the pipe before the process left

    missing = tmp_path / "missing.yaml"
    bad = subprocess.run(
        [sys.executable, "-m", "fitlm.cli", "train", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **TORCHRUN_ENV},
    )
    assert bad.returncode == 2, bad.stderr
    assert str(missing) in bad.stderr


@pytest.mark.process
def test_cli_rank_with_a_bug_exits_1_with_its_traceback():
    proc = python(
        """
        import argparse, sys
        import fitlm.cli as cli
        def broken(args):
            raise RuntimeError("a bug, not a user error")
        parse = argparse.ArgumentParser.parse_args
        def parse_to_broken(self, *a, **k):
            ns = parse(self, *a, **k)
            ns.func = broken
            return ns
        argparse.ArgumentParser.parse_args = parse_to_broken
        sys.exit(cli.main(["config", "docs"]))
    """,
        **TORCHRUN_ENV,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr and "a bug, not a user error" in proc.stderr
