"""Data pipeline on this machine: pack tokens/s per worker count, loader samples/s against the trainer's
rate (forward + backward + AdamW of configs/tiny.yaml's model); near-duplicate precision and recall per
script and edit (bench/near_dup.py's labelled benchmark); local against Ray engine throughput; peak RSS
of a streaming pack as the corpus grows.

Not a test: it prints tables and writes JSON. The loader must outrun the trainer by a wide margin,
or the accelerator waits for data; the "loader / trainer" column is that margin.

    python bench/data.py [--parts throughput,dedup,shingles,engines,rss] [--copies 8] [--seq 256] [--batch 8]
                         [--originals 1000] [--out bench/results/data.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from fitlm.config import ModelConfig
from fitlm.data import PackedDataset, SequenceLoader
from fitlm.data.prep import pack_corpus, train_tokenizer
from fitlm.registry import build_model

ROOT = Path(__file__).resolve().parents[1]
PLAYS = ROOT / "examples" / "data" / "shakespeare"


def corpus(root: Path, copies: int) -> list[Path]:
    """`copies` files per play (the plays repeated), so packing has several MB to chew on."""
    files = []
    for play in sorted(PLAYS.glob("*.txt")):
        text = play.read_text(encoding="utf-8")
        for i in range(copies):
            files.append(root / f"{play.stem}_{i}.txt")
            files[-1].write_text(text, encoding="utf-8")
    return files


def bench_pack(files: list[Path], tok: Path, root: Path, workers: int) -> dict:
    t = time.perf_counter()
    m = pack_corpus(files, tok, root / f"packed-w{workers}", show_progress=False, workers=workers)
    dt = time.perf_counter() - t
    return {
        "workers": workers,
        "tokens": m["num_tokens"],
        "seconds": round(dt, 3),
        "tokens_per_s": round(m["num_tokens"] / dt),
    }


def bench_loader(ds: PackedDataset, seq: int, batch: int, prefetch: int, document_ids: bool, n: int = 200) -> dict:
    loader = SequenceLoader(ds, seq, batch, seed=0, prefetch=prefetch, num_workers=2 if prefetch else 0)
    next(loader)
    t = time.perf_counter()
    for _ in range(n):
        b = next(loader)
        if document_ids:  # what the model would build from them
            from fitlm.models.layers import document_causal_mask

            document_causal_mask(b["document_ids"])
    dt = time.perf_counter() - t
    loader.close()
    return {"prefetch": prefetch, "with_mask": document_ids, "samples_per_s": round(n * batch / dt, 1)}


def bench_trainer(seq: int, batch: int, steps: int = 6, document_mask: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="llama",
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=688,
        vocab_size=2048,
        max_seq_len=max(256, seq),
        tie_embeddings=True,
    )
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 2048, (batch, seq))
    doc = (torch.arange(seq) // 100).expand(batch, seq) if document_mask else None
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(ids, document_ids=doc)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    step = sorted(times[2:])[len(times[2:]) // 2]
    return {"document_mask": document_mask, "step_s": round(step, 4), "samples_per_s": round(batch / step, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    ap.add_argument("--parts", default="throughput,dedup,shingles,engines,rss")
    ap.add_argument("--originals", type=int, default=1000, help="dedup: distinct documents per script")
    ap.add_argument("--dup-copies", type=int, default=50, help="dedup: copies per variant and script")
    ap.add_argument("--rss-scale", type=int, default=20, help="rss: the largest corpus, × the shipped corpora")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "args": vars(args),
    }
    from data_scale import print_dedup, print_engines, print_rss, print_shingles, run_dedup, run_engines, run_rss
    from near_dup import shingle_choices

    if "dedup" in parts:
        result["dedup"] = run_dedup(args.originals, args.dup_copies)
        print_dedup(result["dedup"])
    if "shingles" in parts:
        result["shingles"] = shingle_choices()
        print_shingles(result["shingles"])
    if "engines" in parts:
        result["engines"] = run_engines(args.copies)
        print_engines(result["engines"])
    if "rss" in parts:
        result["rss"] = run_rss(args.rss_scale)
        print_rss(result["rss"])
    if "throughput" in parts:
        result.update(throughput(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


def throughput(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        files = corpus(root, args.copies)
        tok = train_tokenizer(sorted(PLAYS.glob("*.txt")), 2048, root / "tok")
        pack = [bench_pack(files, tok, root, w) for w in sorted({1, 2, os.cpu_count() or 1})]
        ds = PackedDataset(root / "packed-w1")
        loader = [bench_loader(ds, args.seq, args.batch, p, m) for p in (0, 2) for m in (False, True)]
    trainer = [bench_trainer(args.seq, args.batch, document_mask=m) for m in (False, True)]
    train_rate = trainer[0]["samples_per_s"]
    for row in loader:
        row["vs_trainer"] = round(row["samples_per_s"] / train_rate, 1)
    result = {"pack": pack, "loader": loader, "trainer": trainer}

    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"pack ({pack[0]['tokens']:,} tokens)")
    for c in ("workers", "seconds", "tokens/s", "vs 1 worker"):
        t.add_column(c)
    for r in pack:
        t.add_row(
            str(r["workers"]),
            str(r["seconds"]),
            f"{r['tokens_per_s']:,}",
            f"{r['tokens_per_s'] / pack[0]['tokens_per_s']:.2f}",
        )
    con.print(t)
    t = Table(title=f"loader vs trainer (seq {args.seq}, micro batch {args.batch})")
    for c in ("what", "samples/s", "loader / trainer"):
        t.add_column(c)
    for r in loader:
        t.add_row(
            f"loader prefetch={r['prefetch']}{' + mask build' if r['with_mask'] else ''}",
            f"{r['samples_per_s']:,}",
            f"{r['vs_trainer']}x",
        )
    for r in trainer:
        t.add_row(
            f"trainer step (tiny llama{', document mask' if r['document_mask'] else ''})", str(r["samples_per_s"]), ""
        )
    con.print(t)
    return result


if __name__ == "__main__":
    main()
