"""Gloo worlds for the multi-process unit tests: one forkserver-started process per rank, each writing
its results to out_dir/rank{R}.json; a hung world fails the test instead of hanging it."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    worker: Callable, preload: str, world: int, cases, out_dir: Path, timeout: float, what: str
) -> list[dict]:
    """Run `worker(rank, world, port, cases, out_dir)` on `world` ranks; returns each rank's JSON results.

    A forkserver that has imported `preload` (the test module) once forks the workers: a fresh interpreter
    per rank would spend most of the test importing torch again (seconds of CPU each, on 2 cores)."""
    mp.get_context("forkserver").set_forkserver_preload([preload])
    ctx = mp.start_processes(
        worker, args=(world, free_port(), cases, str(out_dir)), nprocs=world, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):  # raises if a worker failed
        if time.monotonic() > deadline:
            for p in ctx.processes:  # a deadlocked world must fail the test, not hang it
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{what} did not finish in {timeout:.0f}s")
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
