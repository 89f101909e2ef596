"""The corpus-scale parts of bench/data.py (issue #22), printed as markdown tables for README/RESULTS:
near-duplicate precision/recall per script and edit, local vs Ray engine throughput, streaming-pack RSS."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import near_dup

ROOT = Path(__file__).resolve().parents[1]
PLAYS = ROOT / "examples" / "data" / "shakespeare"
CHAT = ROOT / "examples" / "data" / "chat" / "chatterbot_corpus.jsonl"
SCRIPTS = ("en", "zh", "ja")
BEFORE = "before: J 0.8, 5-grams, 128 perms"


def run_dedup(originals: int, copies: int) -> dict:
    settings = {"default": {}, BEFORE: {"threshold": 0.8, "num_perm": 128, "ngram": 5}}
    return near_dup.run(SCRIPTS, originals, copies, settings)


def print_dedup(r: dict) -> None:
    d, b = r["settings"]["default"], r["settings"][BEFORE]
    p = d["params"]
    print(
        f"\n### Near duplicates: recall per script and edit ({r['originals']} distinct documents and "
        f"{r['copies_per_variant']} copies per row and script; J >= {p['threshold']}, {p['num_perm']} permutations, "
        f"{p['bands']} bands x {p['rows']} rows, n-grams {p['ngram']}; in brackets: {BEFORE})\n"
    )
    print(
        "| copies | "
        + " | ".join(f"{s} recall" for s in SCRIPTS)
        + " | "
        + " | ".join(f"{s} Jaccard p5" for s in SCRIPTS)
        + " |"
    )
    print("| --- |" + " --- |" * (2 * len(SCRIPTS)))
    for v in near_dup.VARIANTS:
        rec = [f"{d[s]['scores'][v]['rate']:.1%} ({b[s]['scores'][v]['rate']:.0%})" for s in SCRIPTS]
        jac = [f"{r['jaccard'][s][v]['p5']:.2f}" for s in SCRIPTS]
        print(f"| {v} | " + " | ".join(rec + jac) + " |")
    kept = [f"{d[s]['scores']['original']['rate']:.1%} ({b[s]['scores']['original']['rate']:.0%})" for s in SCRIPTS]
    print("| **distinct documents kept** | " + " | ".join(kept) + " |" + " |" * len(SCRIPTS))
    prec = [f"{d[s]['precision']:.1%}" for s in SCRIPTS]
    print("| precision (dropped that were copies) | " + " | ".join(prec) + " |" + " |" * len(SCRIPTS))
    rate = [f"{d[s]['docs_per_s']:,} docs/s, {d[s]['candidates']:,} candidate pairs" for s in SCRIPTS]
    print("| speed, LSH candidates | " + " | ".join(rate) + " |" + " |" * len(SCRIPTS))
    from fitlm.data.prep.dedup import bucket_probability

    print(f"\nS-curve of {p['bands']} x {p['rows']}: P(candidate | Jaccard s) = 1 - (1 - s^{p['rows']})^{p['bands']}\n")
    grid = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    print("| s | " + " | ".join(str(s) for s in grid) + " |\n| --- |" + " --- |" * len(grid))
    print("| P | " + " | ".join(f"{float(bucket_probability(s, p['bands'], p['rows'])):.3f}" for s in grid) + " |")


def print_shingles(r: dict) -> None:
    print(
        "\n### Shingle choice: Jaccard of copies with 3% substituted characters (p5) and of distinct "
        "documents with their most similar other one (p99)\n"
    )
    print("| shingles | " + " | ".join(f"{s} copy p5 | {s} distinct p99" for s in SCRIPTS) + " |")
    print("| --- |" + " --- | --- |" * len(SCRIPTS))
    for name, row in r.items():
        cells = [f"{row[s]['copy_p5']} | {row[s]['distinct_p99']}" if s in row else " | " for s in SCRIPTS]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _corpus(root: Path, copies: int) -> list[Path]:
    """Plays as .txt (`copies` each) and generated Chinese with near copies in 4 .jsonl files."""
    files = []
    for play in sorted(PLAYS.glob("*.txt")):
        for i in range(copies):
            files.append(root / f"{play.stem}_{i}.txt")
            files[-1].write_text(play.read_text(encoding="utf-8"), encoding="utf-8")
    items = near_dup.build("zh", 400 * copies, 10 * copies, seed=5)
    for k in range(4):
        files.append(root / f"zh-{k}.jsonl")
        files[-1].write_text(
            "".join(json.dumps({"text": it.text}, ensure_ascii=False) + "\n" for it in items[k::4]), encoding="utf-8"
        )
    return files


def run_engines(copies: int) -> dict:
    import ray

    from fitlm.data.prep import pack_corpus, train_tokenizer
    from fitlm.data.prep.clean import clean_corpus

    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        files = _corpus(root, max(1, copies // 2))
        mb = sum(f.stat().st_size for f in files) / 1e6
        tok = train_tokenizer(files[:3], 2048, root / "tok")
        t = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        startup = time.perf_counter() - t
        try:
            out = {}
            for step in ("clean", "pack"):
                for engine, workers in (("local", 1), ("local", 2), ("ray", 2)):
                    if step == "clean" and (engine, workers) == ("local", 2):
                        continue  # clean has no worker option on the local engine
                    t = time.perf_counter()
                    dest = root / f"{step}-{engine}-{workers}"
                    if step == "clean":
                        rep = clean_corpus(files, dest, show_progress=False, engine=engine)
                        out[(step, engine, workers)] = [p.read_text() for p in sorted(dest.glob("clean-*"))]
                        n = rep["documents_out"]
                    else:
                        m = pack_corpus(files, tok, dest, show_progress=False, engine=engine, workers=workers)
                        out[(step, engine, workers)] = m["num_tokens"]
                        n = m["num_tokens"]
                    dt = time.perf_counter() - t
                    rows.append(
                        {
                            "step": step,
                            "engine": engine,
                            "workers": workers,
                            "seconds": round(dt, 2),
                            "MB_per_s": round(mb / dt, 2),
                            "output": n,
                        }
                    )
            same_clean = out[("clean", "local", 1)] == out[("clean", "ray", 2)]
            same_pack = out[("pack", "local", 1)] == out[("pack", "ray", 2)]
        finally:
            ray.shutdown()
    return {
        "input_MB": round(mb, 1),
        "files": len(files),
        "ray_startup_s": round(startup, 1),
        "rows": rows,
        "same_documents": same_clean,
        "same_tokens": same_pack,
    }


def print_engines(r: dict) -> None:
    print(
        f"\n### Engines on this machine ({r['files']} files, {r['input_MB']} MB; Ray started once in "
        f"{r['ray_startup_s']} s, not counted; same kept documents: {r['same_documents']}, same tokens: "
        f"{r['same_tokens']})\n"
    )
    print("| step | engine | workers | seconds | MB/s | output |\n| --- | --- | --- | --- | --- | --- |")
    for x in r["rows"]:
        unit = "documents" if x["step"] == "clean" else "tokens"
        print(
            f"| {x['step']} | {x['engine']} | {x['workers']} | {x['seconds']} | {x['MB_per_s']} | "
            f"{x['output']:,} {unit} |"
        )


_PACK = """
import resource, sys, time
from fitlm.data.prep import pack_corpus
t = time.perf_counter()
m = pack_corpus(sys.argv[3:], sys.argv[1], sys.argv[2], show_progress=False, split="line")
print(m["num_tokens"], time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run_rss(scale: int) -> dict:
    """Pack the shipped corpora (plays + the chat corpus's text) repeated 1x and `scale`x, half as .txt
    one document per line, half as .jsonl.gz; peak RSS of the packing process."""
    from fitlm.data.prep import train_tokenizer

    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        lines = [ln for p in sorted(PLAYS.glob("*.txt")) for ln in p.read_text(encoding="utf-8").splitlines() if ln]
        lines += [
            m["content"] for ln in CHAT.read_text(encoding="utf-8").splitlines() for m in json.loads(ln)["messages"]
        ]
        tok = train_tokenizer(sorted(PLAYS.glob("*.txt")), 2048, root / "tok")
        shipped = sum(p.stat().st_size for p in PLAYS.glob("*.txt")) + CHAT.stat().st_size
        for times in (1, scale):
            files = []
            for i in range(times):
                files.append(root / f"x{times}-{i}.txt")
                files[-1].write_text("\n".join(lines[::2]) + "\n", encoding="utf-8")
                files.append(root / f"x{times}-{i}.jsonl.gz")
                with gzip.open(files[-1], "wt", encoding="utf-8") as f:
                    f.writelines(json.dumps({"text": t}) + "\n" for t in lines[1::2])
            raw = times * len("\n".join(lines).encode("utf-8"))
            out = subprocess.run(
                [sys.executable, "-c", _PACK, str(tok), str(root / f"packed-{times}"), *map(str, files)],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
            tokens, secs, rss_kb = out.stdout.split()
            rows.append(
                {
                    "scale": times,
                    "text_MB": round(raw / 1e6, 1),
                    "x_shipped": round(raw / shipped, 1),
                    "tokens": int(tokens),
                    "seconds": round(float(secs), 1),
                    "peak_rss_MB": int(rss_kb) // 1024,
                }
            )
    return {"rows": rows}


def print_rss(r: dict) -> None:
    print("\n### Streaming pack: peak RSS against corpus size (.txt --split line + .jsonl.gz)\n")
    print(
        "| corpus | text MB | × shipped corpora | tokens | seconds | peak RSS MB |\n| --- | --- | --- | --- | --- | --- |"
    )
    for x in r["rows"]:
        print(
            f"| {x['scale']}× | {x['text_MB']} | {x['x_shipped']} | {x['tokens']:,} | {x['seconds']} | "
            f"{x['peak_rss_MB']} |"
        )
