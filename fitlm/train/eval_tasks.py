"""`train.observe.eval_tasks`: lm-evaluation-harness tasks scored at each evaluation of a run, on the weights
being trained, logged to metrics.jsonl (and so the trackers and `fitlm ui`'s charts) as `eval/<task>/<metric>`.

The same tasks `fitlm eval` takes (lm-eval names, fitlm's JSONL task files), through the same `FitlmLM`, so a
score logged at the last step equals `fitlm eval` on the run's saved model (tested). Rank 0 evaluates its copy
of the model (fitlm.rules refuses the layouts that hold no whole copy there) under the run's precision; the other
ranks wait at the next collective.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fitlm.config import Config, ConfigError
from fitlm.data.tokenizer import Tokenizer
from fitlm.eval.results import score_rows
from fitlm.parallel.data_parallel import plain_module


class TaskEvaluator:
    """Built once per run (the task files are read and checked before the first step); `scores(module)` runs
    every task and returns the flat metrics record."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer):
        try:
            import lm_eval  # noqa: F401  - said before training starts, not at the first evaluation
        except ImportError:
            raise ConfigError(
                ["train.observe.eval_tasks needs lm-evaluation-harness: pip install 'fitlm[eval]', or remove the key"]
            ) from None
        from fitlm.eval.local_tasks import local_tasks, task_manager

        o = cfg.train.observe
        self.cfg, self.tokenizer, self.limit = cfg, tokenizer, o.eval_tasks_limit
        self.scratch = Path(tempfile.mkdtemp(prefix="fitlm-eval-tasks-"))
        self.names, made = local_tasks(list(o.eval_tasks), self.scratch, "train.observe.eval_tasks")
        self.manager, unknown = task_manager(self.names, [str(made)] if made else [])
        if unknown:
            self.close()
            raise ConfigError(
                [
                    f"train.observe.eval_tasks: {', '.join(unknown)} unknown to lm-eval; name registered tasks or "
                    ".jsonl task files (docs/evaluation.md)"
                ]
            )

    def scores(self, module: nn.Module) -> dict[str, float]:
        """{"eval/<task>/<metric>": value} for the current weights of `module` (a plain fitlm model)."""
        import lm_eval

        from fitlm.eval.harness import FitlmLM
        from fitlm.memory.precision import autocast

        device = next(module.parameters()).device
        lm = FitlmLM(module=module, tokenizer=self.tokenizer)
        was_training = module.training
        # lm-eval seeds Python's, numpy's and torch's generators: put training's back, so a run with tasks draws
        # (dropout, sampling) what the same run without them draws.
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        module.eval()
        try:
            with torch.no_grad(), autocast(self.cfg.memory, device):
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=self.names, task_manager=self.manager, limit=self.limit, verbosity="WARNING"
                )
        finally:
            module.train(was_training)
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.set_rng_state(rng[2])
        return flat_scores(results["results"])

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def flat_scores(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's results[task]["acc,none"] as {"eval/task/acc": value}; stderr left out (a chart of the score)."""
    return {f"eval/{r['task']}/{r['metric']}": float(r["value"]) for r in score_rows(results)}


__all__ = ["TaskEvaluator", "flat_scores", "plain_module"]
