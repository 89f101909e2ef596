"""fitlm.step.rewards: the built-in reward functions, the user's `module:function` (an importable module or a .py
file) with TRL's signature, the combination (None left out, as TRL's nansum), and errors that name the function and
the prompt."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from fitlm.step.rewards import RewardError, final_answer, load_rewards, score, total_rewards

PROMPTS = ["What is 6 × 7?", "Capital of France?", "What is 1000 + 234?"]


def run(spec: str, completions: list[str], **columns) -> list[float]:
    (reward,) = load_rewards([spec])
    return score([reward], PROMPTS[: len(completions)], completions, columns)[:, 0].tolist()


@pytest.mark.parametrize(
    "completion,answer",
    [
        ("<think>6 × 7</think><answer>42</answer>", "42"),
        ("so 6 × 7 = 42\n#### 42", "42"),
        ("The total is 1,234.0 apples", "1234"),
        ("<answer> Paris </answer>", "Paris"),
    ],
)
def test_answer_equals_reads_the_final_answer_numerically_or_as_text(completion, answer):
    assert run("answer_equals", [completion], answer=[answer]) == [1.0]
    assert run("answer_equals", [completion], answer=["43" if answer != "Paris" else "Lyon"]) == [0.0]


def test_answer_equals_takes_the_last_answer_and_another_column():
    assert final_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert run("answer_equals:solution", ["#### 7", "#### 8"], solution=[7, 9]) == [1.0, 0.0]


def test_format_regex_default_is_the_r1_layout_and_takes_a_pattern():
    good, bad = "<think>because</think>\n<answer>4</answer>", "4"
    assert run("format_regex", [good, bad]) == [1.0, 0.0]
    assert run(r"format_regex:\d$", [good, bad]) == [0.0, 1.0]  # the pattern after the first colon, colons kept


def test_length_rewards_closeness_to_the_target():
    assert run("length:10", ["x" * 10, "x" * 15, "x" * 40]) == [1.0, 0.5, 0.0]


def test_user_function_from_a_py_file_and_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def check(prompts, completions, answer, **kwargs):
                return [1.0 if a in c else None for c, a in zip(completions, answer)]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    for spec in ("my_rewards.py:check", "my_rewards:check"):
        values = run(spec, ["it is 42", "no"], answer=["42", "Paris"])
        assert values[0] == 1.0 and math.isnan(values[1]), spec  # None is NaN: left out of the total
    (reward,) = load_rewards([str(tmp_path / "my_rewards.py") + ":check"])
    assert reward.name.endswith("my_rewards.py:check")


@pytest.mark.parametrize(
    "spec,message",
    [
        ("missing.py:check", "no file"),
        ("no_such_module_xyz:check", "cannot import 'no_such_module_xyz'"),
        ("math:no_such_function", "has no function 'no_such_function'"),
        ("length", "needs a target length"),
        ("format_regex:(", "not a regular expression"),
        ("check", "use a built-in"),
    ],
)
def test_a_function_that_cannot_be_loaded_is_named(spec, message):
    with pytest.raises(RewardError, match="^" + spec.replace("(", r"\(")) as err:
        load_rewards([spec])
    assert message in str(err.value)


def test_a_function_that_raises_names_itself_and_the_prompt(tmp_path, monkeypatch):
    (tmp_path / "bad.py").write_text(
        textwrap.dedent(
            """
            def picky(prompts, completions, **kwargs):
                return [1.0 / len(c) for c in completions]

            def short(prompts, completions, **kwargs):
                return [1.0]

            def text(prompts, completions, **kwargs):
                return ["good"] * len(completions)
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=r"bad.py:picky failed on the prompt 'Capital of France\?'"):
        run("bad.py:picky", ["a", "", "c"])  # only the second completion divides by zero
    with pytest.raises(RewardError, match="bad.py:short returned 1 rewards for 2 completions"):
        run("bad.py:short", ["a", "b"])
    with pytest.raises(RewardError, match="bad.py:text returned 'good' for the prompt 'What is 6 × 7\\?'"):
        run("bad.py:text", ["a"])


def test_a_missing_answer_column_is_named():
    with pytest.raises(RewardError, match="answer_equals failed on the prompt .* no 'answer' column"):
        run("answer_equals", ["#### 1"], solution=["1"])


def test_rewards_combine_by_weight_leaving_none_out_as_trl():
    per_func = torch.tensor([[1.0, 2.0], [float("nan"), 2.0], [float("nan"), float("nan")]])
    total = total_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert total[:2].tolist() == [2.0, 1.0] and math.isnan(total[2])  # unscorable: NaN, out of the baselines
    rewards = load_rewards(["length:1", "format_regex:b"])
    table = score(rewards, ["p", "p"], ["a", "bb"], {})
    assert table.tolist() == [[1.0, 0.0], [0.0, 1.0]] and table.dtype == torch.float32
