"""Bytes per parameter at the peak of a mixed-precision (O2) AdamW step, measured and planned.

Mixed-precision Adam needs 16 bytes per parameter of model states (fp32 master 4 + fp32 gradient 4 + two
fp32 moments 8); the half copies O2 computes with are transient. What a run holds beyond that at its
peak is the engines' overhead: a DDP flat gradient-bucket copy (4), foreach AdamW's state-sized
temporary (4). Each row trains a Llama whose parameters dominate memory (short sequences, micro batch
1) through the real `fitlm profile` (torchrun and gloo for two ranks), and reports the most loaded
rank's peak live tensor bytes (MemTracker) and the analytic plan, both divided by the parameter count.

    python bench/bytes_per_param.py [--out bench/results/bytes_per_param.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PLAYS = ROOT / "examples" / "data" / "shakespeare"
MODEL = {
    "arch": "llama",
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1376,
    "vocab_size": 2048,
    "max_seq_len": 32,
    "tie_embeddings": False,
}
ROWS = [  # (name, parallel, processes)
    ("O2, one process", {}, 1),
    ("O2, dp2 DDP (ZeRO-0)", {"data_parallel": 2}, 2),
    ("O2, dp2 ZeRO-1", {"data_parallel": 2, "zero_stage": 1}, 2),
    ("O2, dp2 ZeRO-2 (FSDP2, per rank)", {"data_parallel": 2, "zero_stage": 2}, 2),
]


def fitlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fitlm.cli", *args], capture_output=True, text=True, cwd=ROOT)


def prepare(tmp: Path) -> tuple[Path, Path]:
    tok = tmp / "tok.json"
    for cmd in (
        ("data", "tokenizer", str(PLAYS / "macbeth_gut.txt"), "--vocab-size", "2048", "--out", str(tok)),
        ("data", "pack", str(PLAYS / "macbeth_gut.txt"), "--tokenizer", str(tok), "--out", str(tmp / "data")),
    ):
        proc = fitlm(*cmd)
        if proc.returncode:
            raise SystemExit(proc.stderr)
    return tok, tmp / "data"


def run_row(tmp: Path, data: Path, name: str, parallel: dict) -> dict:
    slug = "".join(c if c.isalnum() else "_" for c in name)
    cfg = {
        "model": MODEL,
        "data": {"train": str(data), "seq_length": 32},
        "parallel": parallel,
        "memory": {"mixed_precision": "O2"},
        "train": {
            "micro_batch_size": 1,
            "max_steps": 4,
            "eval_interval": 0,
            "progress": False,
            "output_dir": str(tmp / slug / "run"),
            "observe": {"tensorboard": False},
        },
    }
    path = tmp / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = fitlm("profile", str(path), "--steps", "2", "--out", str(tmp / slug / "profile"), "--json")
    if proc.returncode:
        raise SystemExit(f"{name}: {proc.stderr[-3000:]}")
    result = json.loads(proc.stdout)
    params = parameter_count(cfg)
    measured, planned = result["per_device"], result["plan"]["analytic"]["per_device"]
    return {
        "name": name,
        "params": params,
        "measured_bytes": measured["total"],
        "planned_bytes": planned["total"],
        "measured_bytes_per_param": measured["total"] / params,
        "planned_bytes_per_param": planned["total"] / params,
        "measured": {k: v / params for k, v in measured.items()},
        "planned": {k: v / params for k, v in planned.items()},
    }


def parameter_count(cfg: dict) -> int:
    """The model's real parameter count (built on the meta device: no memory)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from fitlm.config import validate_dict
    from fitlm.registry import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(validate_dict(cfg).model).parameters())


def table(rows: list[dict]) -> str:
    out = [
        "| configuration | measured bytes/param | planned bytes/param | measured: params / grads / optimizer / other+activations |",
        "| --- | ---: | ---: | --- |",
    ]
    for r in rows:
        m = r["measured"]
        rest = m.get("other", 0) + m.get("activations", 0) + m.get("logits", 0)
        out.append(
            f"| {r['name']} | {r['measured_bytes_per_param']:.2f} | {r['planned_bytes_per_param']:.2f} | "
            f"{m['params']:.2f} / {m['grads']:.2f} / {m['optimizer']:.2f} / {rest:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bytes_per_param.json")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _, data = prepare(tmp)
        rows = []
        for name, parallel, _ in ROWS:
            rows.append(run_row(tmp, data, name, parallel))
            print(
                f"{name}: measured {rows[-1]['measured_bytes_per_param']:.2f} B/param, "
                f"planned {rows[-1]['planned_bytes_per_param']:.2f}",
                file=sys.stderr,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
