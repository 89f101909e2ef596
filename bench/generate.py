"""Decoding speed on CPU: fitlm's `generate` (KV cache) vs transformers' `generate` on the same weights.

Not a test: it prints a table (or one JSON object). One process builds a random Llama (default ~
SmolLM-like shape scaled down), exports it with `fitlm export --format hf` code, loads the export in
transformers, and times greedy decoding of `--new-tokens` tokens after a `--prompt-len` prompt, both
with a KV cache, `--repeats` times each (median reported). Both see the same threads.

    python bench/generate.py [--hidden 256] [--layers 4] [--new-tokens 64] [--repeats 3] [--json]
                             [--out bench/results/generate.json]

How to read it: tokens/s = new tokens / wall time of one `generate` call (prompt prefill included), so
at batch 1 on a CPU it mostly measures per-token Python and kernel-launch overhead, not FLOPs;
`equal_greedy_tokens` checks that both produced the same tokens from the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, median, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "generate.json")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from fitlm.config import ModelConfig
    from fitlm.export.hf import export_hf
    from fitlm.infer import generate
    from fitlm.models.io import load_model_dir, save_model_dir
    from fitlm.registry import build_model

    heads = max(1, args.hidden // 64)
    cfg = ModelConfig(
        arch="llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        vocab_size=args.vocab,
        max_seq_len=args.prompt_len + args.new_tokens,
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights()
    with tempfile.TemporaryDirectory() as tmp:
        src = save_model_dir(model.eval(), cfg, Path(tmp) / "model")
        loaded = load_model_dir(src)
        export_hf(loaded, Path(tmp) / "hf")
        hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32).eval()
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens

    def fitlm_run() -> list[int]:
        return generate(loaded.model, prompt[0].tolist(), n)

    def hf_run() -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                use_cache=True,
            )
        return out[0, args.prompt_len :].tolist()

    same = fitlm_run() == hf_run()  # also a warm-up for both
    times: dict[str, list[float]] = {"fitlm": [], "transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("fitlm", fitlm_run), ("transformers", hf_run)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    tps = {k: n / median(v) for k, v in times.items()}
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "new_tokens": n,
        "threads": torch.get_num_threads(),
        "fitlm_tokens_per_s": round(tps["fitlm"], 1),
        "transformers_tokens_per_s": round(tps["transformers"], 1),
        "ratio": round(tps["fitlm"] / tps["transformers"], 2),
        "equal_greedy_tokens": same,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        "machine": machine(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    write_json(args.out, result)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>28}  {v}")


if __name__ == "__main__":
    main()
