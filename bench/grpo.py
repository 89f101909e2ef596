"""GRPO on a real small model: fitlm vs TRL's GRPOTrainer on SmolLM2-135M, step time and learning (issue #54).

Not a test. The model is SmolLM2-135M-Instruct as `bench/fetch_smollm2.py` lays it out (its HF export,
bench/.cache/smollm2/hf; run that script once first, nothing is downloaded here). The task is verifiable
and synthetic: prompts "a + b =" (a, b in 1..--max-operand), split by --seed into a training set and a
held-out set, and two reward functions (TRL's signature, weights 1 and 1; the total is 0..2): `closeness`, of
the completion's first number x to a + b, max(0, 1 − |x − (a + b)| / (a + b)) (0 with no number), and
`numeric`, the share of the completion's non-space characters that are not letters (an answer in numbers
rather than prose). Both are dense: a group of G completions almost always has a spread to learn from.

Each contender trains from the same weights, with the same settings, in its own fresh process:

* `fitlm`: as a user runs it, `fitlm data pack --format prompts`, then `fitlm train CONFIG` (the CLI's own entry
  point, run in a child of this file that times `Trainer.train_step` and `GrpoRun.micro_batches` in CPU
  seconds), the config's model section `init_from` the HF directory alone; wall-clock times from its
  metrics.jsonl (`step_seconds`, the sampling phase among them);
* `trl`: `trl.GRPOTrainer` on the same directory (transformers' model and tokenizer), the same reward
  functions (bench/grpo_task.py); per-step times from a callback, the sampling (`_generate_single_turn`:
  transformers' `generate`) timed around its call, on both clocks.

Same: G (num_generations), completions per step (so prompts per step), max_completion_length,
temperature 1, top_p 1, top_k 0, beta 0 (no reference), loss_type, scale_rewards `group`, one policy update
per generation batch, AdamW (lr constant, no warm-up, weight decay 0, betas 0.9/0.999, gradient clip 1.0),
full fine-tuning in fp32, dropout off, `--threads` threads (default 1: on a machine other jobs share, a
2-thread team stalls at every barrier its other thread is descheduled at, and the steps' times scatter 10x).
A round runs each contender for --steps steps; the order alternates from round to round, and the ratio
(TRL's median step / fitlm's) is taken within a round, then the median over rounds, on the wall clock and in the process's CPU seconds (which other jobs on
a shared machine do not inflate). The first step of each run is a warm-up and left out.

Learning: mean reward (and the share of exact sums) of greedy completions of the held-out prompts before
training and after round 1's --steps steps of each contender, all scored by one evaluator (transformers'
greedy `generate` on each model directory: fitlm's output model/, TRL's saved model).

    python bench/fetch_smollm2.py
    python bench/grpo.py [--steps 16] [--rounds 3] [--lr 5e-5] [--threads 1] [--json] [--out bench/results/grpo.json]
    python bench/grpo.py --markdown [JSON]     # the RESULTS.md table of a saved run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, log, machine, median, write_json  # noqa: E402
from fetch_smollm2 import CACHE  # noqa: E402
from grpo_children import fitlm_child, trl_child  # noqa: E402
from grpo_task import REWARDS, TASK, first_number, make_prompts  # noqa: E402

THIS = Path(__file__).resolve()


def hf_dir(model_dir: Path) -> Path:
    """model_dir itself when it is a transformers directory, else (fitlm's output model/) its `fitlm export
    --format hf` beside it."""
    if (model_dir / "config.json").is_file():
        return model_dir
    out = model_dir.parent / "model_hf"
    cmd = [sys.executable, "-m", "fitlm.cli", "export", str(model_dir), "--format", "hf", "--out", str(out)]
    call(cmd, f"fitlm export {model_dir}")
    return out


def evaluate(model_dir: Path, rows: list[dict], max_new: int, threads: int) -> dict:
    """Greedy completions of `rows` by the model in model_dir (transformers), scored by the task's rewards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = hf_dir(model_dir)
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    completions: list[str] = []
    for s in range(0, len(rows), 16):
        enc = tok([r["prompt"] for r in rows[s : s + 16]], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        completions += tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    answers = [r["answer"] for r in rows]
    per_func = {fn.__name__: fn(None, completions, answer=answers) for fn in REWARDS}
    exact = [first_number(c) == a for c, a in zip(completions, answers)]
    return {
        "mean_reward": round(sum(map(sum, per_func.values())) / len(rows), 4),
        **{name: round(sum(v) / len(v), 4) for name, v in per_func.items()},
        "exact": round(sum(exact) / len(exact), 4),
        "examples": [{"prompt": r["prompt"], "completion": c} for r, c in zip(rows[:4], completions)],
    }


def settings(args) -> dict:
    """What both contenders train with (TRL's names)."""
    return {
        "num_generations": args.generations,
        "completions_per_step": args.completions,
        "prompts_per_step": args.completions // args.generations,
        "max_completion_length": args.completion_length,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": args.loss_type,
        "reward_funcs": [fn.__name__ for fn in REWARDS],
        "scale_rewards": "group",
        "learning_rate": args.lr,
        "lr_scheduler": "constant",
        "weight_decay": 0.0,
        "adam_betas": [0.9, 0.999],
        "max_grad_norm": 1.0,
        "precision": "fp32",
        "finetuning": "full",
        "threads": args.threads,
        "steps": args.steps,
    }


def call(cmd: list[str], what: str, threads: int = 1) -> str:
    """Run cmd in a fresh process with `threads` threads; its stdout, or stop naming `what` and its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def fitlm_config(args, model: Path, data: Path, out: Path) -> dict:
    return {
        "model": {"init_from": str(model)},
        "data": {"train": str(data), "format": "prompts", "seq_length": 64},
        "finetune": {
            "objective": "grpo",
            "grpo": {
                "num_generations": args.generations,
                "max_prompt_length": 32,
                "max_completion_length": args.completion_length,
                "temperature": 1.0,
                "beta": 0.0,
                "loss_type": args.loss_type,
                "scale_rewards": "group",
                "reward_funcs": [f"{TASK}:{fn.__name__}" for fn in REWARDS],
            },
        },
        "train": {
            "micro_batch_size": args.completions,
            "gradient_accumulation_steps": 1,
            "max_steps": args.steps,
            "lr": args.lr,
            "min_lr": 0.0,  # (the schedule is constant; min_lr must only not exceed lr)
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "beta1": 0.9,
            "beta2": 0.999,
            "grad_clip": 1.0,
            "seed": args.seed,
            "log_interval": 1,
            "eval_interval": 0,
            "progress": False,
            "output_dir": str(out),
            "observe": {"consistency_interval": 0, "tensorboard": False},
        },
    }


def run_fitlm(args, model: Path, data: Path, out: Path) -> dict:
    """`fitlm train` of the GRPO config in a fresh process; per-step seconds from its metrics.jsonl."""
    import yaml

    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(fitlm_config(args, model, data, out), sort_keys=False))
    stdout = call([sys.executable, str(THIS), "--fitlm-child", str(path)], f"fitlm train {path}", args.threads)
    cpu = json.loads(stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step_seconds" in r]
    if len(cpu["step_cpu_s"]) != len(steps):
        raise SystemExit(f"fitlm train {path}: {len(steps)} steps logged, {len(cpu['step_cpu_s'])} timed")
    return {
        **cpu,
        "step_s": [sum(r["step_seconds"].values()) for r in steps],
        "sampling_s": [r["step_seconds"].get("sampling", 0.0) for r in steps],
        "completion_length": [r["completions/mean_length"] for r in steps],
        "reward": [r["reward"] for r in steps],
        "model_dir": str(out / "model"),
    }


def run_trl(args, model: Path, out: Path) -> dict:
    cmd = [sys.executable, str(THIS), "--trl-child", str(out), "--model", str(model)]
    for key in ("steps", "lr", "seed", "threads", "generations", "completions", "completion_length", "loss_type"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--max-operand", str(args.max_operand), "--held-out", str(args.held_out)]
    stdout = call(cmd, "the TRL child", args.threads)
    return json.loads(stdout.strip().splitlines()[-1])


def pack(model: Path, rows: list[dict], root: Path) -> Path:
    src = root / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "fitlm.cli", "data", "pack", str(src), "--format", "prompts"]
    cmd += ["--tokenizer", str(model / "tokenizer.json"), "--out", str(root / "prompts"), "--max-length", "32"]
    call(cmd, "fitlm data pack")
    return root / "prompts"


def summary(run: dict) -> dict:
    """Medians over a run's steps after the first (its warm-up)."""
    out = {}
    for clock in ("", "_cpu"):  # wall clock, CPU seconds
        step, samp = run[f"step{clock}_s"][1:], run[f"sampling{clock}_s"][1:]
        out[f"step{clock}_s"] = round(median(step), 4)
        out[f"sampling{clock}_s"] = round(median(samp), 4)
        out[f"training{clock}_s"] = round(median([a - b for a, b in zip(step, samp)]), 4)
    out["completion_length"] = round(median(run["completion_length"][1:]), 2)
    return out


def bench(args, root: Path) -> dict:
    """The rounds and the held-out scores; every run's files under root (removed afterwards by the caller)."""
    train, held = make_prompts(args.seed, args.max_operand, args.held_out)
    data = pack(args.model, train, root)
    result: dict = {"benchmark": "grpo", "model": str(args.model), "settings": settings(args), "rounds": []}
    result["task"] = {"train_prompts": len(train), "held_out_prompts": len(held), "max_operand": args.max_operand}
    log(f"evaluating the starting model on {len(held)} held-out prompts")
    result["held_out"] = {"before": evaluate(args.model, held, args.completion_length, args.threads)}
    for r in range(args.rounds):
        order = ["fitlm", "trl"] if r % 2 == 0 else ["trl", "fitlm"]
        runs = {}
        for name in order:
            log(f"round {r + 1}: {name}, {args.steps} steps")
            out = root / f"{name}_{r}"
            runs[name] = run_fitlm(args, args.model, data, out) if name == "fitlm" else run_trl(args, args.model, out)
        sums = {name: summary(run) for name, run in runs.items()}
        sums["trl_over_fitlm"] = round(sums["trl"]["step_s"] / sums["fitlm"]["step_s"], 3)
        sums["trl_over_fitlm_cpu"] = round(sums["trl"]["step_cpu_s"] / sums["fitlm"]["step_cpu_s"], 3)
        result["rounds"].append({"order": order, **sums, "raw": runs})
        if r == 0:
            for name, run in runs.items():
                log(f"evaluating {name}'s model after {args.steps} steps")
                result["held_out"][f"after_{name}"] = evaluate(
                    Path(run["model_dir"]), held, args.completion_length, args.threads
                )
    for key in ("trl_over_fitlm", "trl_over_fitlm_cpu"):
        result[key] = round(median([x[key] for x in result["rounds"]]), 3)
    result["machine"] = machine()
    return result


PARTS = ("step", "sampling", "training")


def markdown(result: dict) -> str:
    s, first = result["settings"], result["rounds"][0]
    lines = [
        "Step times: medians over each run's steps after the first, then over the rounds; held-out scores: greedy, "
        "after round 1.",
        "",
        "| contender | step (s) | sampling (s) | training (s) | step CPU (s) | sampling CPU (s) | training CPU (s) "
        "| completion tokens | held-out reward | closeness | numeric | exact sums |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def scores(h: dict) -> str:
        return " | ".join(f"{h[k]:.3f}" for k in ("mean_reward", "closeness", "numeric", "exact"))

    lines.append(f"| starting model | | | | | | | | {scores(result['held_out']['before'])} |")
    for name, label in (("fitlm", "fitlm `fitlm train`"), ("trl", "TRL `GRPOTrainer`")):
        m = {k: median([x[name][k] for x in result["rounds"]]) for k in first[name]}  # over rounds
        times = " | ".join(f"{m[f'{part}{clock}_s']:.2f}" for clock in ("", "_cpu") for part in PARTS)
        lines.append(
            f"| {label}, after {s['steps']} steps | {times} | {m['completion_length']:.1f} | "
            f"{scores(result['held_out'][f'after_{name}'])} |"
        )
    lines.append("")
    for name, label in (("fitlm", "fitlm"), ("trl", "TRL")):
        reward = first["raw"][name]["reward"]
        k = max(1, len(reward) // 4)
        lines.append(
            f"{label}'s training reward (sampled, round 1): first {k} steps {sum(reward[:k]) / k:.3f}, "
            f"last {k} steps {sum(reward[-k:]) / k:.3f}.  "
        )
    for key, clock in (("trl_over_fitlm", "wall clock"), ("trl_over_fitlm_cpu", "CPU seconds")):
        lines.append(
            f"TRL step / fitlm step, {clock}: {result[key]}x (median over {len(result['rounds'])} round(s); per "
            f"round: {', '.join(str(x[key]) for x in result['rounds'])}).  "
        )
    lines.append(
        f"G={s['num_generations']}, "
        f"{s['prompts_per_step']} prompts ({s['completions_per_step']} completions) a step, max_completion_length="
        f"{s['max_completion_length']}, loss_type={s['loss_type']}, beta=0, lr={s['learning_rate']} constant, "
        f"full fine-tuning in fp32, {s['threads']} thread(s)."
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=CACHE / "hf", help="an HF model dir (bench/fetch_smollm2.py's hf/)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--generations", type=int, default=4, help="G, num_generations")
    ap.add_argument("--completions", type=int, default=8, help="completions a step (G x prompts)")
    ap.add_argument("--completion-length", type=int, default=8, help="max_completion_length")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--max-operand", type=int, default=20)
    ap.add_argument("--held-out", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "grpo.json")
    ap.add_argument("--markdown", nargs="?", const=RESULTS / "grpo.json", type=Path, help="print a saved run's table")
    ap.add_argument("--trl-child", help=argparse.SUPPRESS)
    ap.add_argument("--fitlm-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    if args.fitlm_child:
        fitlm_child(args.fitlm_child)
        return
    if args.trl_child:
        trl_child(args)
        return
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model} holds no HF model: run `python bench/fetch_smollm2.py` first (or pass --model DIR)")
    with tempfile.TemporaryDirectory(prefix="fitlm-grpo-bench-") as tmp:  # ~0.5 GB a trained model
        result = bench(args, Path(tmp))
    write_json(args.out, result)
    print(json.dumps(result) if args.json else markdown(result))


if __name__ == "__main__":
    main()
