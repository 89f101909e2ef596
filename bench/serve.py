"""Serving throughput on CPU: `fitlm serve` with batched decoding vs one request at a time.

Not a test: it prints a table (or one JSON object). It builds a random Llama with a BPE tokenizer
trained on Macbeth, starts `fitlm serve MODEL --port 0 --max-batch B` in a subprocess (so the clients
do not compete with the server for this process's GIL) and sends /v1/completions requests from 1, 4
and 16 concurrent clients (httpx, one thread each), `--requests` in all per row, greedy, `--max-tokens`
each. Every client count runs against --max-batch 1 (requests decoded one at a time, the rest queued)
and --max-batch 16; each server is stopped with SIGTERM.

    python bench/serve.py [--hidden 256] [--layers 4] [--requests 32] [--max-tokens 32] [--json]
                          [--out bench/results/serve.json]

How to read it: requests/s = requests / wall time of the row; tokens/s = completion tokens (from the
responses' usage) / the same time; latency = median seconds per request as its client saw it. With
one client both servers decode one sequence at a time; with more clients the batched server runs one
forward for all of them per step, so tokens/s grows with the batch until the CPU is busy.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PLAYS, RESULTS, machine, median, write_json  # noqa: E402

CLIENTS = (1, 4, 16)
BATCHES = (1, 16)


def build_model(root: Path, hidden: int, layers: int, context: int) -> Path:
    import torch

    from fitlm.config import ModelConfig
    from fitlm.data.prep.tokenizer_train import train_tokenizer
    from fitlm.models.io import save_model_dir
    from fitlm.registry import build_model as build

    tok = train_tokenizer([PLAYS / "macbeth_gut.txt"], 1024, root / "tok" / "tokenizer.json")
    heads = max(1, hidden // 64)
    cfg = ModelConfig(
        arch="llama",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        vocab_size=1024,
        max_seq_len=context,
    )
    torch.manual_seed(0)
    model = build(cfg)
    model.init_weights()
    return save_model_dir(model.eval(), cfg, root / "model", tokenizer_path=tok)


@contextmanager
def served(model_dir: Path, max_batch: int) -> Iterator[str]:
    """`fitlm serve` in a subprocess on a free port; yields its /v1 URL, SIGTERMs it at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fitlm.cli", "serve", str(model_dir), "--port", "0", "--max-batch", str(max_batch)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = proc.stderr.readline()
        if " at http" not in banner:
            raise RuntimeError(f"fitlm serve did not start: {banner}{proc.stderr.read()}")
        yield banner.split(" at ")[-1].strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def run_row(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    import httpx

    prompts = [f"Enter the {i}th messenger, and speaks:" for i in range(requests)]

    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=clients))  # kept-alive connections

    def one(prompt: str) -> tuple[int, float]:
        t = time.perf_counter()
        r = http.post(
            url + "/completions", json={"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter() - t

    t0 = time.perf_counter()
    with http, ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in done)
    return {
        "clients": clients,
        "requests": requests,
        "tokens": tokens,
        "seconds": round(wall, 3),
        "requests_per_s": round(requests / wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "median_latency_s": round(median([s for _, s in done]), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), args.hidden, args.layers, 256)
        for max_batch in BATCHES:
            with served(model_dir, max_batch) as url:
                run_row(url, 1, 2, args.max_tokens)  # warm-up
                rows += [
                    {"max_batch": max_batch, **run_row(url, clients, args.requests, args.max_tokens)}
                    for clients in CLIENTS
                ]
    result = {"machine": machine(), "model": {"hidden": args.hidden, "layers": args.layers}, "rows": rows}
    write_json(args.out, result)
    if args.json:
        print(json.dumps(result))
        return
    base = {r["clients"]: r["tokens_per_s"] for r in rows if r["max_batch"] == 1}
    print("| clients | --max-batch | requests/s | tokens/s | median latency s | vs one at a time |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['clients']} | {r['max_batch']} | {r['requests_per_s']} | {r['tokens_per_s']} | "
            f"{r['median_latency_s']} | {r['tokens_per_s'] / base[r['clients']]:.2f}x |"
        )


if __name__ == "__main__":
    main()
