"""fitlm's own task files (`fitlm eval --tasks FILE.jsonl`): the three row shapes become lm-eval task configs, and a
file that cannot be one is refused naming the file, the row and the fix."""

from __future__ import annotations

import json

import pytest
import yaml

from fitlm.eval.local_tasks import TaskFileError, local_tasks


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_three_shapes_become_lm_eval_tasks(tmp_path):
    mc = write(tmp_path / "mc.jsonl", [{"question": "Q", "choices": ["a", "b"], "label": "b"}])
    abcd = write(tmp_path / "abcd.jsonl", [{"question": "问", "A": "甲", "B": "乙", "C": "丙", "answer": "C"}])
    qa = write(tmp_path / "qa.jsonl", [{"question": "Q:", "answer": "yes"}])
    names, made = local_tasks(["arc_easy", mc, abcd, qa], tmp_path / "tasks")
    assert names == ["arc_easy", "mc", "abcd", "qa"] and made == tmp_path / "tasks"
    spec = {n: yaml.safe_load((made / f"{n}.yaml").read_text()) for n in names[1:]}
    assert spec["mc"]["output_type"] == spec["abcd"]["output_type"] == "multiple_choice"
    assert spec["qa"]["output_type"] == "generate_until" and spec["qa"]["metric_list"][0]["metric"] == "exact_match"
    rows = {n: json.loads((made / f"{n}.data.jsonl").read_text()) for n in names[1:]}
    assert rows["mc"]["label"] == 1  # the right choice's text becomes its index
    assert rows["abcd"] == {"question": "问\nA. 甲\nB. 乙\nC. 丙\nAnswer:", "choices": ["A", "B", "C"], "label": 2}
    assert local_tasks(["arc_easy"], tmp_path / "none") == (["arc_easy"], None)


@pytest.mark.parametrize(
    "rows, says",
    [
        ([{"choices": ["a"], "label": 0}], 'needs a "question"'),
        ([{"question": "Q", "choices": ["a", "b"], "label": 5}], "row 1: the right answer 5 is not one of its 2"),
        ([{"question": "Q", "A": "x", "B": "y", "answer": "E"}], "the right answer 'E'"),
        ([{"question": "Q", "answer": "a"}, {"question": "Q", "choices": ["a"], "label": 0}], "row 2 has another"),
        ([{"question": "Q"}], 'rows need "choices"'),
    ],
)
def test_bad_task_files_name_the_row_and_the_fix(tmp_path, rows, says):
    with pytest.raises(TaskFileError, match=__import__("re").escape(says)):
        local_tasks([write(tmp_path / "t.jsonl", rows)], tmp_path / "tasks")
    with pytest.raises(TaskFileError, match="does not exist"):
        local_tasks([str(tmp_path / "missing.jsonl")], tmp_path / "tasks")
