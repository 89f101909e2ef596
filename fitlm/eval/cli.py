"""`fitlm eval MODEL --tasks NAMES`: lm-evaluation-harness in process, on any MODEL fitlm takes.

The flags mean what lm-eval's do (`--tasks`, `--include-path`, `--limit`, `--num-fewshot`, `--log-samples`,
`--batch-size`); `--out DIR` holds lm-eval's own result and per-sample files (its EvaluationTracker), `--json`
prints lm-eval's results dict (`results[task][metric]`). A training output directory gets `eval.json` (the
same dict) beside its metrics.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any


class EvalError(ValueError):
    """A `fitlm eval` input that cannot run: the message names the flag and the fix."""


def add_commands(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="score a model on lm-evaluation-harness tasks (in process, any MODEL)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run lm-evaluation-harness tasks on MODEL (a fitlm model, run output, HF directory or GGUF "
        "file; --adapter merged in): the same scores as lm-eval's own `hf` model on the same weights. Needs "
        "`pip install 'fitlm[eval]'` (lm-eval).",
        epilog="examples:\n"
        "  fitlm eval runs/tour --tasks my_task --include-path tasks/ --limit 50\n"
        "  fitlm eval models/qwen --adapter runs/lora/adapter --tasks arc_easy,hellaswag --out evals/ --json",
    )
    p.add_argument("model", metavar="MODEL", help="fitlm model dir, training output dir, HF dir or GGUF file")
    p.add_argument(
        "--tasks",
        required=True,
        metavar="NAMES",
        help="comma-separated lm-eval task or group names, or .jsonl task files (docs/evaluation.md)",
    )
    p.add_argument("--adapter", metavar="DIR", help="PEFT LoRA adapter to merge into MODEL first")
    p.add_argument("--include-path", metavar="DIR", help="a folder of task YAML files (your own, offline tasks)")
    p.add_argument("--limit", type=float, metavar="N", help="at most N documents per task (below 1: a fraction)")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (task default)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="prompts scored per forward (default 8)")
    p.add_argument("--max-length", type=int, metavar="T", help="context used (default: the model's)")
    p.add_argument("--log-samples", action="store_true", help="keep each sample's inputs and outputs (with --out)")
    p.add_argument("--out", metavar="DIR", help="write lm-eval's results (and samples) files under DIR")
    p.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (few-shot sampling; default 1234)")
    p.add_argument("--json", action="store_true", help="print lm-eval's results dict as JSON on stdout")
    p.set_defaults(func=cmd_eval)


def _task_manager(include_path: str | None, made: Path | None):
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise EvalError(f"--include-path {include_path}: not a directory; pass the folder holding your task YAMLs")
    paths = [p for p in (include_path, made) if p]
    return TaskManager(include_path=[str(p) for p in paths] or None)


def _check_tasks(names: list[str], manager) -> None:
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise EvalError(
            f"--tasks: {', '.join(unknown)} unknown to lm-eval; name registered tasks (`lm-eval ls tasks`) or put "
            "your task YAML in a folder and pass it with --include-path"
        )


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """lm-eval's results dict (with `samples` when --log-samples)."""
    try:
        import lm_eval
    except ImportError:
        raise EvalError("fitlm eval needs lm-evaluation-harness: pip install 'fitlm[eval]' (or lm-eval)") from None
    from fitlm.eval.harness import FitlmLM
    from fitlm.eval.local_tasks import local_tasks

    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="fitlm-eval-"))  # the task files' lm-eval YAMLs, removed after
    try:
        names, made = local_tasks(names, scratch)
        manager = _task_manager(args.include_path, made)
        _check_tasks(names, manager)
        lm = FitlmLM(args.model, args.adapter, batch_size=args.batch_size, max_length=args.max_length)
        return _evaluate(lm_eval, lm, names, manager, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _evaluate(lm_eval, lm, names: list[str], manager, args: argparse.Namespace) -> dict[str, Any]:
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=manager,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        log_samples=args.log_samples,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )


def _save(results: dict[str, Any], args: argparse.Namespace, plain: dict[str, Any]) -> None:
    """--out: lm-eval's own files (results_*.json, samples_<task>_*.jsonl); a run directory: eval.json."""
    if args.out:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=args.out)
        tracker.general_config_tracker.model_source = "fitlm"
        tracker.general_config_tracker.model_name = str(args.model)
        tracker.save_results_aggregated(results=plain, samples=results.get("samples"))
        for task, samples in (results.get("samples") or {}).items():
            tracker.save_results_samples(task_name=task, samples=samples)
    run = Path(args.model)
    if (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file():  # a training output directory
        (run / "eval.json").write_text(json.dumps(plain, indent=2, default=str) + "\n")


def cmd_eval(args: argparse.Namespace) -> int:
    from lm_eval.utils import handle_non_serializable, make_table

    results = run_eval(args)
    plain = {k: v for k, v in results.items() if k != "samples"}
    plain = json.loads(json.dumps(plain, default=handle_non_serializable))
    _save(results, args, plain)
    if args.json:
        sys.stdout.write(json.dumps(plain) + "\n")
    else:
        sys.stdout.write(make_table(results) + "\n")
    return 0


__all__ = ["EvalError", "add_commands", "cmd_eval", "run_eval"]
