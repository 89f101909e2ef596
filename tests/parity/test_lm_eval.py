"""lm-evaluation-harness against `fitlm serve`, held against lm-eval's own `hf` model on the same checkpoint.

The real `lm_eval` package runs three local tasks (files written here; nothing is downloaded): multiple choice
(loglikelihood), question answering with exact match (generate_until, greedy) and perplexity over text
(loglikelihood_rolling). `--model local-completions` talks to fitlm's OpenAI server as it talks to vLLM's, with
lm-eval's own tokenizer for its token-id requests; each sample's log-likelihoods, generations and every metric
equal the `hf` model's on the transformers checkpoint that fitlm serves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.serve_models import chat_model_dir
from tests.unit.test_serve_api import ServerThread

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models (`lm-eval[api]`)

MC = [
    {"question": "The river flows to the", "choices": [" sea", " mountain", " sky"], "label": 0},
    {"question": "A stone is", "choices": [" hard", " soft"], "label": 0},
    {"question": "Birds can", "choices": [" fly", " swim", " read", " sing"], "label": 2},
]
QA = [{"question": "Q: What is water?\nA:", "answer": " wet"}, {"question": "Q: Name a colour.\nA:", "answer": " red"}]
TEXT = [{"text": "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day."}]
TASKS = {
    "fitlm_mc": ("mc.jsonl", MC, "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                 "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"),
    "fitlm_qa": ("qa.jsonl", QA, "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
                 "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
                 "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
    "fitlm_ppl": ("text.jsonl", TEXT, "output_type: loglikelihood_rolling\ndoc_to_text: '{{text}}'\n"
                  "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"),
}  # fmt: skip
CONTEXT = 128  # the model's, and lm-eval's max_length: the rolling windows fit it


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, (file, rows, spec) in TASKS.items():
        (root / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / file}\n"
        (root / f"{name}.yaml").write_text(head + "test_split: test\n" + spec)
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return chat_model_dir(tmp_path_factory.mktemp("lm_eval_model"), "qwen", context=CONTEXT)


@pytest.fixture(scope="module")
def reference(model_dir, tasks) -> dict:
    """lm-eval's own `hf` model on the transformers checkpoint: the numbers fitlm must give."""
    return evaluate("hf", f"pretrained={model_dir},dtype=float32,max_length={CONTEXT}", tasks)


def evaluate(model: str, model_args: str, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task files are local; never look for a hub
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        device="cpu",
    )


def test_lm_eval_local_completions_against_fitlm_serve_equals_hf(tasks, model_dir, reference):
    from fitlm.serve.app import create_app
    from fitlm.serve.model import load_served

    d, ref = model_dir, reference
    served = load_served(d)
    with ServerThread(create_app(served, max_batch=4)) as s:
        args = (
            f"base_url={s.url}/completions,model={served.name},tokenizer={d},tokenizer_backend=huggingface,"
            f"tokenized_requests=True,max_length={CONTEXT},num_concurrent=1,max_retries=1"
        )
        ours = evaluate("local-completions", args, tasks)
    for task in TASKS:
        a, b = ours["samples"][task], ref["samples"][task]
        assert len(a) == len(b) == len(TASKS[task][1])
        for x, y in zip(a, b):
            if task == "fitlm_qa":
                assert x["filtered_resps"] == y["filtered_resps"]  # greedy generations, cut at the stop
            else:
                got = [r[0] if isinstance(r, (list, tuple)) else r for r in x["filtered_resps"]]
                want = [r[0] if isinstance(r, (list, tuple)) else r for r in y["filtered_resps"]]
                assert got == pytest.approx(want, abs=1e-3)  # summed log-likelihoods (fp32 sums over tokens)
        metrics = {k: v for k, v in ref["results"][task].items() if k.endswith(",none") and "stderr" not in k}
        assert metrics and {k: ours["results"][task][k] for k in metrics} == pytest.approx(metrics, rel=1e-4)


def test_fitlm_eval_in_process_equals_hf_and_writes_lm_evals_files(tasks, model_dir, reference, tmp_path, capsys):
    from fitlm.cli import main

    d, ref = model_dir, reference
    out = tmp_path / "evals"
    argv = ["eval", str(d), "--tasks", ",".join(TASKS), "--include-path", str(tasks), "--batch-size", "2"]
    assert main([*argv, "--log-samples", "--out", str(out), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for task in TASKS:
        metrics = {k: v for k, v in ref["results"][task].items() if k.endswith(",none") and "stderr" not in k}
        assert metrics and {k: ours["results"][task][k] for k in metrics} == pytest.approx(metrics, rel=1e-4)
    written = list(out.rglob("results_*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["results"].keys() == ours["results"].keys()
    for task in TASKS:  # lm-eval's per-sample files, one line per document, with fitlm's log-likelihoods
        (samples,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        assert len(rows) == len(TASKS[task][1])
        if task == "fitlm_mc":
            got = [[float(r[0]) for r in row["filtered_resps"]] for row in rows]  # lm-eval writes strings
            want = [[r[0] for r in s["filtered_resps"]] for s in ref["samples"][task]]
            assert got == [pytest.approx(w, abs=1e-3) for w in want]


def test_fitlm_eval_refuses_unknown_tasks_naming_the_flag(tasks, model_dir, tmp_path, capsys):
    from fitlm.cli import main

    d = model_dir
    assert main(["eval", str(d), "--tasks", "no_such_task", "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert "--tasks: no_such_task unknown to lm-eval" in err and "--include-path" in err
    assert main(["eval", str(d), "--tasks", "fitlm_mc", "--include-path", str(tmp_path / "none")]) == 2
    assert "--include-path" in capsys.readouterr().err


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"


def test_fitlm_task_files_score_as_lm_evals_hf_model_on_the_same_task(model_dir, tmp_path, capsys):
    # The shipped examples (multiple choice, C-Eval-style A/B/C/D in Chinese, exact answers) as a user runs them
    from fitlm.cli import main
    from fitlm.eval.local_tasks import local_tasks

    files = sorted(str(p) for p in EXAMPLES.glob("*.jsonl"))
    assert len(files) == 3
    assert main(["eval", str(model_dir), "--tasks", ",".join(files), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    names, made = local_tasks(files, tmp_path / "tasks")  # the same task YAMLs, for lm-eval's own model
    from lm_eval.tasks import TaskManager

    ref = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32,max_length={CONTEXT}",
        tasks=names,
        task_manager=TaskManager(include_path=str(made)),
        device="cpu",
    )["results"]
    assert set(ours) == set(names) == {"shakespeare_mc", "shakespeare_zh_abcd", "shakespeare_qa"}
    for task in names:
        metrics = {k: v for k, v in ref[task].items() if k.endswith(",none") and "stderr" not in k}
        assert metrics and {k: ours[task][k] for k in metrics} == pytest.approx(metrics, rel=1e-4)
