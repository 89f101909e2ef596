"""fitlm's best vs the HF Trainer's best as users run them: every contender in its own fresh process (issue #17).

Not a test. bench/train_throughput.py interleaves the contenders step by step inside one process, which
cancels a shared machine's load but also shares process-wide state between them: fitlm's Trainer sets the
host allocator for the whole process (`train.host_allocator: reuse`, fitlm.host_allocator), so the HF
Trainer's steps there run with it too. Here each contender is a child process that builds its trainer, runs
`--warmup` + `--steps` steps and reports its step times and minor page faults per step:

* `fitlm`: fitlm's best (`--fitlm-best`, as in bench/train_throughput.py), with the allocator fitlm picks;
* `fitlm_system`: the same with `train.host_allocator: system` (glibc's defaults), so the table separates
  what the allocator gives from what the step itself gives;
* `hf_sdpa` / `hf_eager`: the HF Trainer's best (bf16 where the CPU has a fast bf16 path, else fp32, +
  torch_compile, as in bench/train_throughput.py), transformers' default attention and
  the eager one, in a plain Python process (glibc's defaults, as a standalone HF Trainer script has them);
* `hf_sdpa_jemalloc` / `hf_eager_jemalloc`: the same with jemalloc preloaded and configured as Intel's CPU tuning
  guides advise (`LD_PRELOAD`, `MALLOC_CONF` below): what an HF user who tunes the allocator gets. Run where
  jemalloc is installed (Debian: `apt-get install libjemalloc2`; `--jemalloc PATH` names another copy).

Same weights, data and targets as bench/train_throughput.py. A round runs every contender once; the order
rotates from round to round, so a slow drift of the machine's load does not favour one of them. Ratios are
taken within a round (HF's median step / fitlm's), then the median over rounds.

    python bench/train_standalone.py [--sizes s-2k m-8k l-32k] [--rounds 3] [--steps 8] [--warmup 3]
                                     [--contenders fitlm hf_eager] [--no-compile]
                                     [--out bench/results/train_standalone.json]
    python bench/train_standalone.py --markdown [JSON]     # the RESULTS.md table of a saved run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, fitlm_config, fitlm_step, hf_model_from_fitlm, machine, median, prepare_data, write_json  # noqa: E402
from train_throughput import SIZES, batches_for, describe, hf_best_precision, hf_trainer, log, parse_fitlm_best  # noqa: E402

CONTENDERS = ("fitlm", "fitlm_system", "hf_sdpa", "hf_eager", "hf_sdpa_jemalloc", "hf_eager_jemalloc")
HF = tuple(c for c in CONTENDERS if c.startswith("hf_"))
# Intel's advice for PyTorch on Xeon (never give memory back, a background purge thread, huge-page metadata).
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


def find_jemalloc(given: Path | None) -> Path | None:
    if given is not None:
        if not given.is_file():
            raise SystemExit(
                f"--jemalloc {given}: no such file; install jemalloc (Debian: apt-get install "
                "libjemalloc2) or name its libjemalloc.so.2"
            )
        return given
    return next((Path(p) for p in JEMALLOC_PATHS if Path(p).is_file()), None)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def jemalloc_mapped() -> bool:
    """Whether this process runs with jemalloc loaded (the preload took effect)."""
    try:
        return "libjemalloc" in Path("/proc/self/maps").read_text()
    except OSError:  # no procfs
        return False


def child(name: str, size: str, data_dir: Path, out_dir: Path, args) -> dict:
    """One contender's steps in this (fresh) process: step wall times and minor page faults per step."""
    import torch

    best = best_settings(args)
    extra = {"host_allocator": "system"} if name == "fitlm_system" else {}
    cfg = fitlm_config(SIZES[size], data_dir, out_dir / name, args.batch, args.seq, best, **extra)
    steps = args.warmup + args.steps
    times, faults = [], []
    if name.startswith("fitlm"):
        from fitlm.train.trainer import Trainer

        step = fitlm_step(Trainer(cfg))
        for _ in range(steps):
            f0, t0 = minor_faults(), time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            faults.append(minor_faults() - f0)
    else:
        from transformers import TrainerCallback

        from fitlm.registry import build_model

        torch.manual_seed(cfg.train.seed)  # the seed fitlm's Trainer builds its model with: same weights
        model = hf_model_from_fitlm(build_model(cfg.model), cfg.model, name.split("_")[1])  # hf_<attention>[_...]
        mark = {}

        class Clock(TrainerCallback):
            def on_step_begin(self, a, s, c, **kw):
                mark["f"], mark["t"] = minor_faults(), time.perf_counter()

            def on_step_end(self, a, s, c, **kw):
                times.append(time.perf_counter() - mark["t"])
                faults.append(minor_faults() - mark["f"])

        with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its summary: stdout carries the JSON
            precision = hf_best_precision("auto", "cpu")
            hf_trainer(
                model, batches_for(cfg, steps + 2), out_dir / name, steps, precision, args.compile, [Clock()]
            ).train()
    timed = times[args.warmup :]
    return {
        "name": name,
        "jemalloc": jemalloc_mapped(),
        "step_s": round(median(timed), 4),
        "min_step_s": round(min(timed), 4),
        "compile_s": round(max(0.0, times[0] - median(timed)), 2),
        "faults_per_step": median(faults[args.warmup :]),
        "step_times_s": [round(t, 4) for t in times],
    }


def best_settings(args) -> dict:
    best = parse_fitlm_best(args.fitlm_best, "cpu")
    if not args.compile:
        best.pop("compile", None)
    return best


def run_child(name: str, size: str, data_dir: Path, out_dir: Path, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--_child",
        name,
        size,
        str(data_dir),
        str(out_dir),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--fitlm-best",
        args.fitlm_best,
    ] + ([] if args.compile else ["--no-compile"])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if name.endswith("_jemalloc"):
        env.update(LD_PRELOAD=f"{args.jemalloc} {env.get('LD_PRELOAD', '')}".strip(), MALLOC_CONF=JEMALLOC_CONF)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} ({size}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_size(size: str, data_dir: Path, tmp: Path, args) -> dict:
    tokens = args.batch * args.seq
    runs: dict[str, list[dict]] = {c: [] for c in args.contenders}
    for r in range(args.rounds):
        order = list(args.contenders[r % len(args.contenders) :]) + list(args.contenders[: r % len(args.contenders)])
        for name in order:
            log(f"[{size}] round {r + 1}/{args.rounds}: {name}")
            runs[name].append(run_child(name, size, data_dir, tmp / size / f"round{r}", args))
    res = {
        "size": size,
        "vocab_size": SIZES[size]["vocab_size"],
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "fitlm_best_settings": describe(best_settings(args)),
        "hf_trainer_best_settings": hf_best_precision("auto", "cpu") + (" + torch_compile" if args.compile else ""),
    }
    for name, rs in runs.items():
        res[name] = {
            "tokens_per_s": round(tokens / median([x["step_s"] for x in rs]), 1),
            "round_step_s": [x["step_s"] for x in rs],
            "min_step_s": min(x["min_step_s"] for x in rs),
            "faults_per_step": median([x["faults_per_step"] for x in rs]),
            "compile_s": median([x["compile_s"] for x in rs]),
            "runs": rs,
        }
    for ours in ("fitlm", "fitlm_system"):
        for theirs in HF:
            if ours in runs and theirs in runs:
                per_round = [b / a for a, b in zip(res[ours]["round_step_s"], res[theirs]["round_step_s"])]
                res[f"{ours}_vs_{theirs}"] = {
                    "ratio": round(median(per_round), 3),
                    "rounds": [round(x, 3) for x in per_round],
                    "min_step": round(res[theirs]["min_step_s"] / res[ours]["min_step_s"], 3),
                }
    return res


LABELS = {
    "fitlm": "fitlm best",
    "fitlm_system": "fitlm best, glibc allocator",
    "hf_sdpa": "HF best (SDPA)",
    "hf_eager": "HF best (eager attention)",
    "hf_sdpa_jemalloc": "HF best (SDPA), jemalloc",
    "hf_eager_jemalloc": "HF best (eager attention), jemalloc",
}
SHORT = {
    "hf_sdpa": "SDPA",
    "hf_eager": "eager",
    "hf_sdpa_jemalloc": "SDPA + jemalloc",
    "hf_eager_jemalloc": "eager + jemalloc",
}


def table(report: dict) -> str:
    m = report["machine"]
    results = report["results"]
    present = [c for c in CONTENDERS if any(c in r for r in results)]
    theirs = [c for c in present if c in HF]
    lines = [
        f"- Machine: {m['cpus']} CPUs ({m['cpu']}, {m['threads']} torch threads), load average at the end "
        f"{m.get('load_avg_1m', '?')}; Python {m['python']}, torch {m['torch']}, transformers {m.get('transformers', '-')}",
        f"- Command: `{report['command']}` ({report['wall_s']:.0f} s)",
        "- Each contender in its own process; tokens/s of the median step after warm-up, median over rounds; "
        "ratios > 1 favour fitlm (each round's ratio of median steps, median over rounds; in brackets from the "
        "fastest step of each); faults: minor page faults per step (median)",
        "",
        "| size | "
        + " | ".join(f"{LABELS[c]} | faults" for c in present)
        + " | "
        + " | ".join(f"fitlm / HF {SHORT[c]}" for c in theirs)
        + (
            " | same, glibc allocator (" + " / ".join(SHORT[c] for c in theirs) + ")"
            if "fitlm_system" in present
            else ""
        )
        + " |",
        "| --- |" + " ---: | ---: |" * len(present) + " ---: |" * (len(theirs) + ("fitlm_system" in present)),
    ]

    def cell(r, name):
        return f"{r[name]['tokens_per_s']:,.0f} | {r[name]['faults_per_step']:,.0f}" if name in r else "- | -"

    def ratio(r, key):
        return f"{r[key]['ratio']:.2f}× ({r[key]['min_step']:.2f}×)" if key in r else "-"

    for r in results:
        row = [r["size"], *(cell(r, c) for c in present), *(ratio(r, f"fitlm_vs_{c}") for c in theirs)]
        if "fitlm_system" in present:
            row.append(" / ".join(ratio(r, f"fitlm_system_vs_{c}") for c in theirs))
        lines.append("| " + " | ".join(row) + " |")
    r0 = results[0]
    lines += [
        "",
        f"fitlm best: {r0['fitlm_best_settings']}; HF Trainer best: {r0.get('hf_trainer_best_settings', 'bf16 + torch_compile')}.",
    ]
    if any(c.endswith("_jemalloc") for c in present):
        lines[-1] += f" jemalloc: `MALLOC_CONF={JEMALLOC_CONF}`."
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["s-2k", "m-8k", "l-32k"], choices=list(SIZES))
    ap.add_argument(
        "--contenders",
        nargs="+",
        default=None,
        choices=CONTENDERS,
        help="default: all (the jemalloc ones where jemalloc is installed)",
    )
    ap.add_argument("--jemalloc", type=Path, default=None, help="libjemalloc.so.2 to preload (default: the system's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per contender and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (compile, optimizer states)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--fitlm-best", default="auto", help="as in bench/train_throughput.py")
    ap.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="both best runs without torch.compile (quick checks, e.g. the smoke test)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--markdown", nargs="?", type=Path, const=RESULTS / "train_standalone.json", metavar="JSON")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.markdown:
        print(table(json.loads(args.markdown.read_text())))
        return
    if args._child:
        name, size, data_dir, out_dir = args._child
        print(json.dumps(child(name, size, Path(data_dir), Path(out_dir), args)))
        return
    import tempfile

    args.jemalloc = find_jemalloc(args.jemalloc)
    if args.contenders is None:
        args.contenders = [c for c in CONTENDERS if args.jemalloc or not c.endswith("_jemalloc")]
        if not args.jemalloc:
            log("jemalloc not found: the hf_*_jemalloc contenders are left out (apt-get install libjemalloc2)")
    elif not args.jemalloc and any(c.endswith("_jemalloc") for c in args.contenders):
        raise SystemExit(
            "--contenders names a jemalloc contender but jemalloc is not installed: apt-get install "
            "libjemalloc2, or pass --jemalloc PATH"
        )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = prepare_data(Path(tmp))
        results = [run_size(size, data_dir, Path(tmp), args) for size in args.sizes]
    report = {
        "benchmark": "train_standalone",
        "machine": machine(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "results": results,
    }
    print(table(report))
    log(f"wrote {write_json(args.out or RESULTS / 'train_standalone.json', report)}")


if __name__ == "__main__":
    main()
