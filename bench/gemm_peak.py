"""Measured peak GEMM FLOP/s of this machine per dtype: the ceiling MFU is measured against (issue #11).

Not a test: it prints a table (or one JSON object) and writes JSON. Square matrix products of several
sizes per dtype, best of `--repeats`, with fitlm's own measurement (fitlm.hardware.measure_gemm_flops,
which `fitlm train`/`profile` and `fitlm plan --device cpu` use), so the peak here is the one MFU is
reported against. On a CPU, half precision has a fast path only with AVX512-BF16/AMX (oneDNN); without
it (`bf16_fast: false`) a bf16 GEMM runs about 30-100x slower than fp32, and only small sizes are tried.
On a GPU the datasheet peak (fitlm.hardware.GPU_PEAK_TFLOPS) is printed beside the measurement.

    python bench/gemm_peak.py [--sizes 512 1024 2048] [--dtypes fp32 bf16] [--repeats 5] [--json]
                              [--out bench/results/gemm_peak.json]

Without --out nothing is written: checking a machine's peak leaves the committed results file alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bf16_matmul_fast, machine, write_json  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def measure(device: str, dtypes: list[str], sizes: list[int], repeats: int) -> dict:
    import torch

    from fitlm import hardware as metrics

    fast = bf16_matmul_fast(device)
    out: dict = {"device": device, "bf16_fast": fast, "per_dtype": {}}
    for name in dtypes:
        dtype = getattr(torch, DTYPES[name])
        # Slow half precision (no oneDNN path): the same slow kernel at any size; keep it to seconds.
        use = sizes if name == "fp32" or fast else [min(256, min(sizes))]
        rows = {}
        for n in use:
            metrics.forget_measured_peaks(torch.device(device), dtype)
            rows[str(n)] = metrics.measure_gemm_flops(torch.device(device), dtype, n=n, repeats=repeats)
        out["per_dtype"][name] = {"by_size": rows, "peak_flops": max(rows.values())}
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        out["datasheet_bf16_flops"] = next((v * 1e12 for k, v in metrics.GPU_PEAK_TFLOPS.items() if k in name), None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[512, 1024, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the JSON report here (the committed run: bench/results/gemm_peak.json)",
    )
    args = ap.parse_args()
    report = {
        "benchmark": "gemm_peak",
        "machine": machine(),
        **measure(args.device, args.dtypes, args.sizes, args.repeats),
    }
    if args.out:
        write_json(args.out, report)
    if args.json:
        print(json.dumps(report))
        return
    print("| dtype | size | GFLOP/s |\n| --- | ---: | ---: |")
    for name, d in report["per_dtype"].items():
        for n, f in d["by_size"].items():
            print(f"| {name} | {n} | {f / 1e9:,.1f} |")
    print(f"bf16 fast path: {report['bf16_fast']}" + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
