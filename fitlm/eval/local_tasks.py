"""fitlm's own task files: a JSONL a user writes in minutes, turned into an lm-eval task (a YAML beside it in a
scratch folder), so `fitlm eval MODEL --tasks my_questions.jsonl` needs no lm-eval task knowledge.

Three row shapes, any language (the prompt is the user's text; nothing is translated):
- multiple choice: {"question", "choices": [...], "label": index or the right choice's text};
- C-Eval / CMMLU / MMLU style: {"question", "A", "B", "C", "D" (as many letters as given), "answer": "B"}: the
  options are listed under the question and the letters are the choices, as those benchmarks score them;
- exact answer: {"question", "answer"}: greedy generation up to the first newline, exact match after trimming
  spaces, case and punctuation.
Scored as lm-eval scores its own tasks: accuracy (and length-normalised accuracy) for choices, exact_match for
answers. The task is named after the file (`my_questions`).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import yaml

LETTERS = string.ascii_uppercase


class TaskFileError(ValueError):
    """A task file fitlm cannot turn into a task: the message names the file, the row and the fix."""


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise TaskFileError(f"{path}:{i}: not valid JSON ({e}); one JSON object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise TaskFileError(f'{path}:{i}: each row needs a "question" text (see docs/evaluation.md)')
        rows.append(row)
    if not rows:
        raise TaskFileError(f"{path}: no rows; one JSON object per line")
    return rows


def _shape(path: Path, row: dict[str, Any]) -> str:
    if "choices" in row:
        return "choices"
    if "A" in row and "B" in row:
        return "letters"
    if isinstance(row.get("answer"), str):
        return "answer"
    raise TaskFileError(
        f'{path}: rows need "choices" + "label", options "A", "B", ... + "answer" (a letter), or a text "answer"'
    )


def _normalised(path: Path, rows: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """(shape, rows as {"question", "choices", "label"} or {"question", "answer"}) with every row checked."""
    shape = _shape(path, rows[0])
    out = []
    for i, row in enumerate(rows, 1):
        if _shape(path, row) != shape:
            raise TaskFileError(f"{path}: row {i} has another shape than row 1; one shape per file")
        q = row["question"]
        if shape == "answer":
            out.append({"question": q, "answer": row["answer"]})
            continue
        if shape == "letters":
            letters = [x for x in LETTERS if isinstance(row.get(x), str)]
            q = q + "\n" + "\n".join(f"{x}. {row[x]}" for x in letters) + "\nAnswer:"
            choices, label = letters, row.get("answer")
        else:
            choices, label = row["choices"], row.get("label")
        if isinstance(label, str) and label in choices:
            label = choices.index(label)
        if not isinstance(label, int) or not 0 <= label < len(choices):
            raise TaskFileError(
                f"{path}: row {i}: the right answer {label!r} is not one of its {len(choices)} choices; give its index "
                "or its text (a letter for A/B/C/D rows)"
            )
        out.append({"question": q, "choices": [str(c) for c in choices], "label": label})
    return shape, out


def task_yaml(path: Path, data_file: Path) -> dict[str, Any]:
    """The lm-eval task config for `path`, reading its normalised rows from `data_file` (written here)."""
    shape, rows = _normalised(path, _rows(path))
    data_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    spec: dict[str, Any] = {
        "task": path.stem,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "doc_to_text": "{{question}}",
    }
    if shape == "answer":
        trim = {"ignore_case": True, "ignore_punctuation": True, "regexes_to_ignore": ["^\\s+", "\\s+$"]}
        return spec | {
            "output_type": "generate_until",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 64, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True, **trim}],
        }
    return spec | {
        "output_type": "multiple_choice",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")],
    }


def local_tasks(names: list[str], scratch: Path) -> tuple[list[str], Path | None]:
    """`--tasks` with task files (.jsonl) turned into tasks in `scratch`: (task names, the folder to include)."""
    out, made = [], False
    for name in names:
        path = Path(name)
        if path.suffix != ".jsonl":
            out.append(name)
            continue
        if not path.is_file():
            raise TaskFileError(f"--tasks: {name} does not exist; pass a task name or a .jsonl task file")
        scratch.mkdir(parents=True, exist_ok=True)
        spec = task_yaml(path, scratch / f"{path.stem}.data.jsonl")
        (scratch / f"{path.stem}.yaml").write_text(yaml.safe_dump(spec, allow_unicode=True, sort_keys=False))
        out.append(path.stem)
        made = True
    return out, scratch if made else None


__all__ = ["TaskFileError", "local_tasks", "task_yaml"]
