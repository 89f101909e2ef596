"""train.observe.eval_tasks through the CLI: lm-eval tasks scored at every evaluation of a run, logged to
metrics.jsonl as eval/<task>/<metric>; the last step's scores equal `fitlm eval` on the saved model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

pytest.importorskip("lm_eval")
TASKS = Path(__file__).resolve().parents[2] / "examples" / "eval"


def test_scores_at_each_evaluation_equal_fitlm_eval_of_the_saved_model(tiny_corpus, tmp_path):
    files = [str(TASKS / "shakespeare_mc.jsonl"), str(TASKS / "shakespeare_qa.jsonl")]
    observe = {"eval_tasks": files, "eval_tasks_limit": 3}
    cfg = tiny_config(tiny_corpus, tmp_path / "run", train={"max_steps": 4, "eval_interval": 2, "observe": observe})
    proc = fitlm("train", write_config(tmp_path / "run.yaml", cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [r for r in read_metrics(tmp_path / "run") if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in logged] == [2, 4]
    assert {"eval/shakespeare_mc/acc", "eval/shakespeare_mc/acc_norm", "eval/shakespeare_qa/exact_match"} <= set(
        logged[-1]
    )
    out = fitlm("eval", tmp_path / "run", "--tasks", ",".join(files), "--limit", "3", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    want = {f"eval/{t}/{k.split(',')[0]}": v for t, m in results.items() for k, v in m.items() if k.endswith(",none")}
    want = {k: v for k, v in want.items() if not k.endswith("_stderr")}
    assert {k: logged[-1][k] for k in want} == pytest.approx(want, abs=1e-6)
    assert (tmp_path / "run" / "eval.json").is_file()  # fitlm eval of a run writes its scores beside it


def test_a_missing_task_file_stops_the_run_before_it_starts(tiny_corpus, tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    cfg = tiny_config(tiny_corpus, tmp_path / "run", train={"observe": {"eval_tasks": [str(missing)]}})
    proc = fitlm("train", write_config(tmp_path / "run.yaml", cfg))
    assert proc.returncode == 2 and f"train.observe.eval_tasks: {missing} does not exist" in proc.stderr
    assert not (tmp_path / "run").exists()
