"""Training throughput and memory: fitlm vs the Hugging Face transformers Trainer vs a hand-written loop,
against the machine's measured GEMM peak (issue #11).

Not a test: it prints a table (stderr with --json) and writes JSON. For each model size, one process:

* builds a fitlm Llama and the same network as transformers' `LlamaForCausalLM` with the same weights
  (fitlm.models.hf), over the same packed data (Macbeth, bench/memory.py's recipe) and batches: the HF
  Trainer reads a Dataset of the rows of fitlm's batches in order, with `shift_labels` set to fitlm's
  labels, so both predict exactly the same targets;
* **identical settings** (fp32, no compile, same AdamW hyper-parameters, grad clip 1.0): the HF Trainer
  drives its loop, and a callback at the end of each of its steps runs one fitlm step (`Trainer.train_step`)
  and one step of a minimal hand-written loop (`loop`: the HF model, F.cross_entropy, AdamW foreach, clip)
  — the contenders are interleaved step by step, so a shared machine slows them alike;
* **best settings**: the HF Trainer with `torch_compile=True` and bf16 (`bf16=True`, autocast) where bf16
  matmuls have a fast path, interleaved the same way with fitlm's best (`--fitlm-best`; default:
  memory.compile, which takes the whole model with its chunked loss in one process, + chunked loss,
  precision O2 bf16 where bf16 is fast, else O0). On a CPU without AVX512-BF16/AMX
  (oneDNN reports no bf16 support) bf16 GEMMs run ~100x slower than fp32, so there both "best" runs use fp32
  (override with --hf-best-precision bf16 / --fitlm-best "O3,compile,chunk=1024"); both call torch's SDPA
  for attention (--hf-best-attn eager gives the HF model its matmul attention instead; `both` adds a second best
  run per round against the HF model with eager attention, so fitlm's best meets the HF Trainer's best either way);
* compile time is the first step's excess over the median step, reported apart; steps after `--warmup`
  are timed (median);
* `--rounds` (3) repeats both runs of a size; tokens/s are medians over rounds of each round's median step,
  and each ratio is taken within a round (same load for both contenders), then its median over rounds;
* memory at identical settings, each framework in its own child process: peak bytes held by live tensors
  over one training step (torch's MemTracker, fitlm.memory.tracking.peak_live_bytes: parameters, grads,
  optimizer states, activations, temporaries) for fitlm's Trainer and for the HF Trainer's
  `training_step` + clip + its optimizer's step, and each process's peak RSS beside it.

One process serves all contenders, so process-wide state is shared: fitlm's Trainer sets the host allocator
(`train.host_allocator: reuse`) for the whole process, and the HF Trainer's steps after it run with it too.
bench/train_standalone.py runs fitlm's best and the HF Trainer's best each in its own fresh process instead, as
users run them.

fitlm's identical-settings run uses fitlm's chunked loss (`--identical-chunk`, exact same math, no full
[tokens x vocab] logits); `fitlm_plain_*` fields give fitlm with loss_chunk_size 0 for comparison.

    python bench/train_throughput.py [--json] [--sizes s-2k m-8k l-32k] [--steps 4] [--warmup 2] [--rounds 3]
                                     [--batch 8] [--seq 256] [--profile] [--no-compile]
                                     [--out bench/results/train_throughput.json]
    python bench/train_throughput.py --markdown [bench/results/train_throughput.json]   # RESULTS.md tables

Without --json the table goes to stdout and the JSON to --out; with --json exactly one JSON object is
printed on stdout (written to --out only when --out is given). --no-compile drops compile from both
best runs (quick checks, e.g. the smoke test; not the issue's comparison).

How to read the numbers: `*_tokens_per_s` = batch × seq / median step time after warm-up;
`*_min_step_s` is the fastest timed step (on a shared machine, the ratios `*_ratio_min_step` built from
it are less exposed to another job's bursts than the medians); `identical_ratio`, `best_ratio` > 1 favour
fitlm; `memory_ratio` < 1 favours fitlm. `fitlm_best_mfu` = fitlm's best tokens/s × model FLOPs per token
(fitlm.train.metrics: 6 × matmul parameters + 12·L·h·s attention) / `gemm_peak_flops`, the measured large-GEMM peak of the dtype
fitlm's best run computes in (bf16 for O1-O3, fp32 for O0); it is the share of the machine's matmul
speed the whole step achieves, so the non-GEMM work (attention, norms, optimizer, casts) lowers it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    RESULTS,
    bf16_matmul_fast,
    fitlm_config,
    fitlm_step,
    gemm_peak,
    hf_model_from_fitlm,
    log,
    machine,  # noqa: E402
    median,
    prepare_data,
    profile_step,
    rss_bytes,
    write_json,
)

# Llama shapes. l-32k has a realistic vocabulary: its [tokens x vocab] logits dominate memory.
SIZES = {
    "s-2k": {
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 2048,
        "tie_embeddings": False,
    },
    "m-8k": {
        "hidden_size": 384,
        "num_layers": 6,
        "num_heads": 6,
        "num_kv_heads": 6,
        "intermediate_size": 1024,
        "vocab_size": 8192,
        "tie_embeddings": False,
    },
    "l-32k": {
        "hidden_size": 384,
        "num_layers": 4,
        "num_heads": 6,
        "num_kv_heads": 2,
        "intermediate_size": 1024,
        "vocab_size": 32000,
        "tie_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1024,
        "tie_embeddings": False,
    },
}
LR, WD, BETAS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1.0


# --------------------------------------------------------------------------- settings


def parse_fitlm_best(spec: str, device: str) -> dict:
    """'auto' or e.g. 'O3,compile,chunk=1024' -> a fitlm memory section."""
    if spec == "auto":
        # O2 (bf16 compute, fp32 master weights and AdamW) measured fastest of O1-O3 here; chunks of 4096
        # rows keep the compiled per-chunk loss kernels few; on CPU the blocked matmul attention with its
        # probabilities kept beats the flash kernel and the matmul backward alone (fitlm.models.matmul_attention).
        spec = (
            ("O2" if bf16_matmul_fast(device) else "O0")
            + (",attn=matmul_saved" if device == "cpu" else "")
            + ",compile,chunk=4096"
        )
    mem: dict = {}
    for part in filter(None, spec.split(",")):
        if part in ("O0", "O1", "O2", "O3"):
            mem["mixed_precision"] = part
        elif part == "compile":
            mem["compile"] = True
        elif part.startswith("chunk="):
            mem["loss_chunk_size"] = int(part.split("=", 1)[1])
        elif part in ("selective", "full"):
            mem["recompute"] = part
        elif part.startswith("attn="):
            mem["attention_backward"] = part.split("=", 1)[1]
        else:
            raise SystemExit(
                f"--fitlm-best: unknown part {part!r} (use O0-O3, compile, chunk=N, selective, full, "
                "attn=sdpa|matmul|matmul_saved)"
            )
    return mem


def hf_best_precision(choice: str, device: str) -> str:
    if choice == "auto":
        return "bf16" if bf16_matmul_fast(device) else "fp32"
    return choice


def describe(mem: dict) -> str:
    parts = [mem.get("mixed_precision", "O0")]
    if mem.get("compile"):
        parts.append("compile")
    if mem.get("loss_chunk_size"):
        parts.append(f"chunked loss {mem['loss_chunk_size']}")
    if mem.get("recompute", "none") != "none":
        parts.append(f"recompute {mem['recompute']}")
    if mem.get("attention_backward", "sdpa") != "sdpa":
        parts.append(f"{mem['attention_backward']} attention")
    return " + ".join(parts)


# --------------------------------------------------------------------------- contenders


def batches_for(cfg, n: int) -> list[dict]:
    """The first n batches fitlm's Trainer reads (same dataset, seed and loader)."""
    from fitlm.data.dataset import PackedDataset
    from fitlm.data.loader import SequenceLoader

    loader = SequenceLoader.from_config(
        PackedDataset(cfg.data.train), cfg.data, cfg.train.micro_batch_size, seed=cfg.train.seed, shuffle=True
    )
    return [next(loader) for _ in range(n)]


def hf_trainer(model, batches: list[dict], out: Path, steps: int, precision: str, compile_: bool, callbacks=()):
    """transformers.Trainer over the rows of `batches` in order (fitlm's labels as `shift_labels`)."""
    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainingArguments

    rows = [
        {"input_ids": b["input_ids"][i], "labels": b["labels"][i], "shift_labels": b["labels"][i]}
        for b in batches
        for i in range(b["input_ids"].shape[0])
    ]

    class Rows(Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batches[0]["input_ids"].shape[0],
        learning_rate=LR,
        weight_decay=WD,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        max_grad_norm=CLIP,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=precision == "bf16",
        torch_compile=compile_,
        seed=1234,
    )
    return InOrder(model=model, args=args, train_dataset=Rows(), callbacks=list(callbacks))


def loop_step(model, batches: list[dict]):
    """The "no framework" reference: plain PyTorch on the HF model (logits, F.cross_entropy, AdamW, clip)."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=True)
    it = iter(range(10**9))

    def step():
        b = batches[next(it) % len(batches)]
        labels = b["labels"]
        n = max(1, int((labels != -100).sum()))
        logits = model(input_ids=b["input_ids"]).logits  # [B,T,V]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def interleaved(trainer, others: dict) -> dict[str, list[float]]:
    """Run trainer.train(); after each of its steps run one step of every other contender. Returns the
    per-step wall times of all (the HF step includes its data loading and bookkeeping)."""
    from transformers import TrainerCallback

    times: dict[str, list[float]] = {"hf": [], **{k: [] for k in others}}
    mark = {"t": None}

    class Interleave(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if mark["t"] is None:  # first step: start the clock after the Trainer's setup
                mark["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times["hf"].append(time.perf_counter() - mark["t"])
            for name, step in others.items():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
            mark["t"] = time.perf_counter()

    trainer.add_callback(Interleave())
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its summary: keep stdout for --json
        trainer.train()
    return times


def steady(times: list[float], warmup: int) -> tuple[float, float]:
    """(median step time after warm-up, first step's excess over it = compile/first-call cost)."""
    med = median(times[warmup:])
    return med, max(0.0, times[0] - med)


# --------------------------------------------------------------------------- memory (child process)


def measure_memory(framework: str, size: str, data_dir: Path, batch: int, seq: int, chunk: int) -> dict:
    import torch

    from fitlm.memory.tracking import peak_live_bytes
    from fitlm.registry import build_model
    from fitlm.train.trainer import Trainer

    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp())
    model_cfg = SIZES[size]
    if framework.startswith("fitlm"):
        mem = {"loss_chunk_size": chunk} if framework == "fitlm" else {}
        trainer = Trainer(fitlm_config(model_cfg, data_dir, tmp / "run", batch, seq, mem))
        step = fitlm_step(trainer)
        step()  # optimizer states exist from here on
        live = peak_live_bytes(step, trainer.pm.modules, trainer.step.optimizer, warmup_steps=0)
        return {"peak_live_bytes": live, "rss_bytes": rss_bytes()}
    cfg = fitlm_config(model_cfg, data_dir, tmp / "run", batch, seq)
    torch.manual_seed(cfg.train.seed)
    model = hf_model_from_fitlm(build_model(cfg.model), cfg.model)
    batches = batches_for(cfg, 4)
    trainer = hf_trainer(model, batches, tmp / "hf", 4, "fp32", False)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    it = iter(range(10**9))

    def step():
        b = batches[next(it) % len(batches)]
        inputs = {"input_ids": b["input_ids"], "labels": b["labels"], "shift_labels": b["labels"]}
        n_items = (b["labels"] != -100).sum()
        trainer.training_step(model, inputs, n_items)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        trainer.optimizer.step()
        model.zero_grad()

    step()
    live = peak_live_bytes(step, [model], trainer.optimizer, warmup_steps=0)
    return {"peak_live_bytes": live, "rss_bytes": rss_bytes()}


def memory_in_child(framework: str, size: str, data_dir: Path, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--_memory",
        framework,
        size,
        str(data_dir),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--identical-chunk",
        str(args.identical_chunk),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"memory measurement {framework} {size} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- one size


def measure_round(size: str, data_dir: Path, tmp: Path, args, best_mem: dict, hf_prec: str, r: int) -> dict:
    """One round: the identical-settings run, then the best-settings run, each interleaved step by step.
    Returns every contender's step times, the FLOPs per token and (with --profile) the top ops."""
    import torch

    from fitlm.registry import build_model
    from fitlm.train.trainer import Trainer

    model_cfg = SIZES[size]
    steps = args.warmup + args.steps
    id_mem = {"loss_chunk_size": args.identical_chunk} if args.identical_chunk else {}
    root = tmp / size / f"round{r}"
    cfg = fitlm_config(model_cfg, data_dir, root / "fitlm", args.batch, args.seq, id_mem)
    batches = batches_for(cfg, steps + 2)

    def hf_copy(attn: str = "sdpa"):
        torch.manual_seed(cfg.train.seed)  # the seed fitlm's Trainer builds its model with: same weights
        return hf_model_from_fitlm(build_model(cfg.model), cfg.model, attn)

    # Identical settings: HF Trainer fp32 eager drives; fitlm (fp32 eager) and the loop step in between.
    log(
        f"[{size}] round {r + 1}/{args.rounds} identical settings (fp32, eager): HF Trainer, fitlm, loop "
        f"interleaved, {steps} steps each"
    )
    fit_id = Trainer(cfg)
    contenders = {"fitlm": fitlm_step(fit_id), "loop": loop_step(hf_copy(), batches)}
    if args.plain:
        plain = Trainer(fitlm_config(model_cfg, data_dir, root / "plain", args.batch, args.seq, {}))
        contenders["fitlm_plain"] = fitlm_step(plain)
    hf_id = hf_trainer(hf_copy(), batches, root / "hf", steps, "fp32", False)
    times = interleaved(hf_id, contenders)
    prof = {}
    if args.profile and r == 0:
        prof["fitlm"] = profile_step(contenders["fitlm"], f"{size} fitlm identical")
        prof["loop"] = profile_step(contenders["loop"], f"{size} loop (HF model)")
    flops_per_token = fit_id.flops_per_token
    del fit_id, contenders, hf_id
    gc.collect()

    # Best settings: HF Trainer (compile + bf16 where fast) drives; fitlm's best steps in between.
    log(
        f"[{size}] round {r + 1}/{args.rounds} best settings: HF Trainer ({hf_best_desc(hf_prec, args)}) vs "
        f"fitlm ({describe(best_mem)})"
    )
    # Both compile afresh, as each would in its own process: dynamo's cache per code object fills across rounds and
    # sizes otherwise, and the accelerate forward every HF model shares hit its recompile_limit and ran eager.
    torch._dynamo.reset()
    fit_best = Trainer(fitlm_config(model_cfg, data_dir, root / "best", args.batch, args.seq, best_mem))
    best_step = fitlm_step(fit_best)
    hf_best = hf_trainer(hf_copy(hf_best_attn(args)), batches, root / "hf_best", steps, hf_prec, args.compile)
    t_best = interleaved(hf_best, {"fitlm_best": best_step})
    times.update(fitlm_best=t_best["fitlm_best"], hf_trainer_best=t_best["hf"], hf_trainer=times.pop("hf"))
    if args.hf_best_attn == "both":
        # A second best run, fitlm's best against the HF model with its matmul ("eager") attention, which on a CPU
        # in bf16 beats SDPA's flash backward: the HF Trainer's best whichever attention its user picks.
        log(
            f"[{size}] round {r + 1}/{args.rounds} best settings: HF Trainer ({hf_best_desc(hf_prec, args, 'eager')}) "
            f"vs fitlm ({describe(best_mem)})"
        )
        torch._dynamo.reset()
        hf_eager = hf_trainer(hf_copy("eager"), batches, root / "hf_best_eager", steps, hf_prec, args.compile)
        t_eager = interleaved(hf_eager, {"fitlm_best": best_step})
        times.update(fitlm_best_vs_eager=t_eager["fitlm_best"], hf_trainer_best_eager=t_eager["hf"])
        del hf_eager
    if args.profile and r == 0:
        prof["fitlm_best"] = profile_step(best_step, f"{size} fitlm best")
    del fit_best, hf_best, best_step
    gc.collect()
    return {"times": times, "flops_per_token": flops_per_token, "profile": prof}


def hf_best_attn(args) -> str:
    """The HF model's attention in the (first) best run: `both` runs SDPA there and eager in a second one."""
    return "sdpa" if args.hf_best_attn == "both" else args.hf_best_attn


def hf_best_desc(hf_prec: str, args, attn: str | None = None) -> str:
    attn = attn or hf_best_attn(args)
    return hf_prec + (" + torch_compile" if args.compile else "") + ("" if attn == "sdpa" else f" + {attn} attention")


def run_size(size: str, data_dir: Path, tmp: Path, args, best_mem: dict, hf_prec: str) -> dict:
    """`args.rounds` rounds of `measure_round`; every figure is the median over rounds of that round's median
    step (or ratio), so a burst of another job's work that hits one round moves the result little."""
    rounds = [measure_round(size, data_dir, tmp, args, best_mem, hf_prec, r) for r in range(args.rounds)]
    model_cfg = SIZES[size]
    tokens = args.batch * args.seq
    id_mem = {"loss_chunk_size": args.identical_chunk} if args.identical_chunk else {}
    r = {
        "size": size,
        "model": model_cfg,
        "vocab_size": model_cfg["vocab_size"],
        "batch": args.batch,
        "seq": args.seq,
        "tokens_per_step": tokens,
        "flops_per_token": rounds[0]["flops_per_token"],
        "rounds": args.rounds,
        "fitlm_settings": describe(id_mem),
        "fitlm_best_settings": describe(best_mem),
        "hf_trainer_best_settings": hf_best_desc(hf_prec, args),
        "loop_model": "transformers LlamaForCausalLM",
    }
    for key in (
        "fitlm",
        "hf_trainer",
        "loop",
        "fitlm_plain",
        "fitlm_best",
        "hf_trainer_best",
        "fitlm_best_vs_eager",
        "hf_trainer_best_eager",
    ):
        per_round = [x["times"][key] for x in rounds if x["times"].get(key)]
        if not per_round:
            continue
        meds = [steady(times, args.warmup)[0] for times in per_round]
        med = median(meds)
        r[f"{key}_tokens_per_s"] = round(tokens / med, 1)
        r[f"{key}_step_s"] = round(med, 4)
        r[f"{key}_round_step_s"] = [round(m, 4) for m in meds]
        r[f"{key}_min_step_s"] = round(min(t for times in per_round for t in times[args.warmup :]), 4)
        r[f"{key}_step_times_s"] = [round(t, 4) for times in per_round for t in times]
        if key.endswith("best"):  # the first round compiles; later rounds find the graphs in torch's caches
            r[f"{key}_compile_s"] = round(steady(per_round[0], args.warmup)[1], 2)
    if rounds[0]["profile"]:
        r["profile"] = rounds[0]["profile"]
    if args.memory:
        log(f"[{size}] memory at identical settings (child processes)")
        fm = memory_in_child("fitlm", size, data_dir, args)
        hm = memory_in_child("hf", size, data_dir, args)
        r.update(
            fitlm_peak_bytes=fm["peak_live_bytes"]["total"],
            hf_trainer_peak_bytes=hm["peak_live_bytes"]["total"],
            fitlm_peak_breakdown=fm["peak_live_bytes"],
            hf_trainer_peak_breakdown=hm["peak_live_bytes"],
            fitlm_rss_bytes=fm["rss_bytes"],
            hf_trainer_rss_bytes=hm["rss_bytes"],
        )
        if args.identical_chunk:
            pm = memory_in_child("fitlm_plain", size, data_dir, args)
            r.update(fitlm_plain_peak_bytes=pm["peak_live_bytes"]["total"], fitlm_plain_rss_bytes=pm["rss_bytes"])
        r["memory_ratio"] = round(r["fitlm_peak_bytes"] / r["hf_trainer_peak_bytes"], 3)
    # Each ratio is taken within a round (the contenders stepped in turn, under the same load), then the
    # median over rounds.
    pairs = {"identical": ("fitlm", "hf_trainer"), "best": ("fitlm_best", "hf_trainer_best")}
    if "hf_trainer_best_eager_step_s" in r:
        pairs["best_eager"] = ("fitlm_best_vs_eager", "hf_trainer_best_eager")
        r["hf_trainer_best_eager_settings"] = hf_best_desc(hf_prec, args, "eager")
    for name, (ours, theirs) in pairs.items():
        per_round = [b / a for a, b in zip(r[f"{ours}_round_step_s"], r[f"{theirs}_round_step_s"])]
        r[f"{name}_ratio_rounds"] = [round(x, 3) for x in per_round]
        r[f"{name}_ratio"] = round(median(per_round), 3)
        # From the fastest timed step of each: the median can catch bursts of another job in one contender's
        # steps and not in the other's; the minimum rarely does.
        r[f"{name}_ratio_min_step"] = round(r[f"{theirs}_min_step_s"] / r[f"{ours}_min_step_s"], 3)
    return r


# --------------------------------------------------------------------------- main


def table(report: dict) -> str:
    """The bench/RESULTS.md tables of one run (also what --markdown prints from a saved JSON)."""
    mib = 2**20
    m = report["machine"]
    res = report["results"]
    lines = [
        f"- Machine: {m['cpus']} CPUs ({m['cpu']}, {m['threads']} torch threads), load average at the end "
        f"{m.get('load_avg_1m', '?')}; Python {m['python']}, torch {m['torch']}, transformers {m.get('transformers', '-')}",
        f"- Command: `{report.get('command', 'python bench/train_throughput.py')}` ({report.get('wall_s', 0):.0f} s)",
        "- Measured GEMM peak: "
        + ", ".join(f"{k} {v / 1e9:,.0f} GFLOP/s" for k, v in report["gemm_peak_flops"].items()),
        f"- Batch {res[0]['batch']} × sequence {res[0]['seq']}; tokens/s of the median step after warm-up, "
        f"median over {res[0].get('rounds', 1)} rounds; ratios > 1 favour fitlm: each round's ratio of median "
        "steps (contenders interleaved step by step), median over rounds; in brackets from the fastest step of each",
        "",
        "| size | vocab | fitlm | HF Trainer | loop | fitlm / HF (min step) | fitlm best | HF best "
        "| best ratio (min step) | fitlm best MFU | compile s fitlm / HF |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res:
        lines.append(
            f"| {r['size']} | {r['vocab_size']:,} | {r['fitlm_tokens_per_s']:,.0f} | {r['hf_trainer_tokens_per_s']:,.0f} | "
            f"{r['loop_tokens_per_s']:,.0f} | {r['identical_ratio']:.2f}× ({r.get('identical_ratio_min_step', 0):.2f}×) | "
            f"{r['fitlm_best_tokens_per_s']:,.0f} | {r['hf_trainer_best_tokens_per_s']:,.0f} | "
            f"{r['best_ratio']:.2f}× ({r.get('best_ratio_min_step', 0):.2f}×) | "
            f"{r['fitlm_best_mfu']:.0%} of {r['gemm_peak_dtype']} | "
            f"{r.get('fitlm_best_compile_s', 0):.0f} / {r.get('hf_trainer_best_compile_s', 0):.0f} |"
        )
    lines += [
        "",
        "Identical = fp32 eager, same data, AdamW and clip; fitlm "
        + res[0]["fitlm_settings"]
        + ". Best: "
        + "; ".join(
            sorted({f"fitlm {r['fitlm_best_settings']}, HF Trainer {r['hf_trainer_best_settings']}" for r in res})
        )
        + ".",
    ]
    if any("best_eager_ratio" in r for r in res):  # --hf-best-attn both
        lines += [
            "",
            "| size | fitlm best | HF best, eager attention | best ratio vs eager (min step) | "
            "faster HF best | fitlm / faster HF best |",
            "| --- | ---: | ---: | ---: | --- | ---: |",
        ]
        for r in res:
            if "best_eager_ratio" not in r:
                continue
            eager_wins = r["hf_trainer_best_eager_step_s"] < r["hf_trainer_best_step_s"]
            lines.append(
                f"| {r['size']} | {r['fitlm_best_vs_eager_tokens_per_s']:,.0f} | "
                f"{r['hf_trainer_best_eager_tokens_per_s']:,.0f} | {r['best_eager_ratio']:.2f}× "
                f"({r['best_eager_ratio_min_step']:.2f}×) | {'eager' if eager_wins else 'SDPA'} | "
                f"{min(r['best_ratio'], r['best_eager_ratio']):.2f}× |"
            )
    if any("fitlm_peak_bytes" in r for r in res):
        lines += [
            "",
            "| size | vocab | peak live MiB fitlm | HF Trainer | fitlm / HF | fitlm, full logits | "
            "peak RSS MiB fitlm / HF |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in res:
            if "fitlm_peak_bytes" not in r:
                continue
            plain = f"{r['fitlm_plain_peak_bytes'] / mib:,.0f}" if "fitlm_plain_peak_bytes" in r else "-"
            lines.append(
                f"| {r['size']} | {r['vocab_size']:,} | {r['fitlm_peak_bytes'] / mib:,.0f} | "
                f"{r['hf_trainer_peak_bytes'] / mib:,.0f} | {r['memory_ratio']:.2f}× | {plain} | "
                + (
                    f"{r['fitlm_rss_bytes'] / mib:,.0f} / {r['hf_trainer_rss_bytes'] / mib:,.0f} |"
                    if "fitlm_rss_bytes" in r
                    else "- |"
                )
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["s-2k", "m-8k", "l-32k"], choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=4, help="timed steps per contender (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (compile, optimizer states)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="repeat each size's identical and best runs; medians and ratios over rounds",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--fitlm-best", default="auto", help="e.g. 'O0,compile,chunk=1024' or 'O3,compile,chunk=1024'")
    ap.add_argument("--hf-best-precision", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument(
        "--hf-best-attn",
        default="sdpa",
        choices=["sdpa", "eager", "both"],
        help="the HF model's attn_implementation in the best run (sdpa: transformers' default, the "
        "kernel fitlm calls too)",
    )
    ap.add_argument(
        "--identical-chunk",
        type=int,
        default=1024,
        help="fitlm's loss_chunk_size at identical settings (0 = full logits like HF)",
    )
    ap.add_argument("--plain", action="store_true", help="also time fitlm with loss_chunk_size 0 at identical settings")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory child processes")
    ap.add_argument("--profile", action="store_true", help="torch.profiler top ops of one step of fitlm and the loop")
    ap.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="best runs without torch.compile on both sides (quick checks; not the issue's setting)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--markdown",
        nargs="?",
        type=Path,
        const=RESULTS / "train_throughput.json",
        metavar="JSON",
        help="print the bench/RESULTS.md table of a saved run (default: the results file) and exit",
    )
    ap.add_argument("--_memory", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.markdown:
        print(table(json.loads(args.markdown.read_text())))
        return
    if args._memory:
        fw, size, data_dir = args._memory
        print(json.dumps(measure_memory(fw, size, Path(data_dir), args.batch, args.seq, args.identical_chunk)))
        return

    device = "cpu"
    best_mem = parse_fitlm_best(args.fitlm_best, device)
    if not args.compile:
        best_mem.pop("compile", None)
    hf_prec = hf_best_precision(args.hf_best_precision, device)
    best_dtype = {"O0": "fp32", "O1": "bf16", "O2": "bf16", "O3": "bf16"}[best_mem.get("mixed_precision", "O0")]
    hf_dtype = hf_prec  # the HF Trainer's best computes its matmuls in this dtype (autocast)
    t_start = time.perf_counter()
    peaks = {d: gemm_peak(d, device) for d in ("fp32", "bf16")}
    log(
        "GEMM peak: "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
        + ("" if bf16_matmul_fast(device) else " (no fast bf16 matmul on this CPU: best runs use fp32)")
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir = prepare_data(tmp)
        for size in args.sizes:
            results.append(run_size(size, data_dir, tmp, args, best_mem, hf_prec))
            if args.out and not args.json:
                write_json(args.out, {"results": results})
    # Re-measure the peak at the end (a shared machine may have been busier at the start): keep the best.
    from fitlm import hardware as metrics

    metrics.forget_measured_peaks()
    peaks = {d: max(v, gemm_peak(d, device)) for d, v in peaks.items()}
    for r in results:
        r["gemm_peak_flops"] = peaks[best_dtype]
        r["gemm_peak_dtype"] = best_dtype
        r["fitlm_best_mfu"] = round(r["fitlm_best_tokens_per_s"] * r["flops_per_token"] / peaks[best_dtype], 6)
        r["hf_trainer_best_mfu"] = round(r["hf_trainer_best_tokens_per_s"] * r["flops_per_token"] / peaks[hf_dtype], 6)
        for key in ("fitlm", "hf_trainer", "loop"):
            r[f"{key}_mfu_fp32"] = round(r[f"{key}_tokens_per_s"] * r["flops_per_token"] / peaks["fp32"], 6)
    report = {
        "benchmark": "train_throughput",
        "machine": machine(),
        "gemm_peak_flops": peaks,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "results": results,
    }
    text = table(report)
    if args.json:
        log(text)
        if args.out:
            write_json(args.out, report)
        print(json.dumps(report))
        return
    print(text)
    out = write_json(args.out or RESULTS / "train_throughput.json", report)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
