"""GRPO's reward functions (`finetune.grpo.reward_funcs`): the built-ins and the user's own, loaded and called
with TRL's convention.

A reward function takes the batch's prompts and completions (texts, one prompt per completion: a group's prompt
repeated G times) and every other column of the prompt rows as keyword lists (`answer=[...]`), and returns one
reward per completion: a float, or None where it does not apply (TRL: None is left out of the total, and a
completion no function scored gets advantage 0):

    def check(prompts, completions, **columns) -> list[float | None]

reward_funcs names each one as

    answer_equals[:COLUMN]   1.0 when the completion's final answer equals the row's COLUMN (default `answer`):
                             the text inside the last <answer>…</answer>, else after the last `####`, else the
                             whole completion; compared as numbers (the last number in it) when the column holds
                             one, else as text with surrounding whitespace stripped
    format_regex[:PATTERN]   1.0 when PATTERN (Python re, DOTALL) is found in the completion; default the
                             <think>…</think><answer>…</answer> layout of DeepSeek-R1's recipe
    length:N                 closeness of the completion's character count to N: 1 − |chars − N| / N, at least 0
    module:function          the user's function: an importable module, or a .py file (`rewards.py:check`,
                             relative to the working directory), loaded from that file only, never from a
                             model directory

A built-in's name is matched before the colon, so a user module cannot be called answer_equals, format_regex or
length (a file, `length.py:f`, can). A function that raises, returns another count than the completions, or a
value that is not a number stops the run with its name and the prompt.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

RewardFn = Callable[..., list]  # (prompts, completions, **columns) -> list[float | None]

R1_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"  # DeepSeek-R1's reasoning-then-answer layout
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


class RewardError(ValueError):
    """A reward function that cannot be loaded, or that failed on a batch: names it, and what to do."""


@dataclass(frozen=True)
class Reward:
    """A loaded reward function and the name it is logged under (rewards/<name>/mean)."""

    name: str
    fn: RewardFn


def final_answer(completion: str) -> str:
    """The completion's final answer: inside the last <answer>…</answer>, else after the last `####` (GSM8K's
    marker), else the whole completion; stripped."""
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    return completion.rsplit("####", 1)[-1].strip()


def as_number(text: str) -> float | None:
    """The last number in text (thousands commas dropped), or None when it has none."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def answers_equal(completion: str, expected: Any) -> bool:
    """Whether the completion's final answer is `expected`: numerically when expected is a number (1,234 and
    1234.0 are), else as text."""
    answer, want = final_answer(completion), str(expected).strip()
    if NUMBER.fullmatch(want):
        got = as_number(answer)
        return got is not None and math.isclose(got, float(want.replace(",", "")), rel_tol=1e-9, abs_tol=1e-9)
    return answer == want


def answer_equals(column: str) -> RewardFn:
    def reward(prompts: list, completions: list[str], **columns: list) -> list[float | None]:
        if column not in columns:
            raise RewardError(
                f"the prompt rows have no {column!r} column (they have {sorted(columns) or 'none'}); add it to the "
                f"data, or name the column holding the answer: answer_equals:COLUMN"
            )
        return [float(answers_equal(c, e)) for c, e in zip(completions, columns[column])]

    return reward


def format_regex(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts: list, completions: list[str], **columns: list) -> list[float | None]:
        return [float(compiled.search(c) is not None) for c in completions]

    return reward


def length(target: int) -> RewardFn:
    def reward(prompts: list, completions: list[str], **columns: list) -> list[float | None]:
        return [max(0.0, 1.0 - abs(len(c) - target) / target) for c in completions]

    return reward


def builtin(name: str, param: str | None) -> RewardFn:
    """The built-in `name` with its parameter (the text after the colon, None when absent)."""
    if name == "answer_equals":
        return answer_equals(param or "answer")
    if name == "format_regex":
        try:
            return format_regex(param or R1_FORMAT)
        except re.error as e:
            raise RewardError(f"format_regex:{param}: not a regular expression ({e}); fix the pattern") from e
    if not (param and param.isdigit() and int(param) > 0):
        raise RewardError(f"length: needs a target length in characters, e.g. length:200 (got {param!r})")
    return length(int(param))


BUILTINS = ("answer_equals", "format_regex", "length")


def user_function(spec: str) -> RewardFn:
    """`module:function` or `path.py:function`: the user's reward function, imported from that module or file."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise RewardError(
            f"{spec}: not a reward function; use a built-in ({', '.join(BUILTINS)}) or module:function, "
            "e.g. rewards.py:check"
        )
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise RewardError(f"{spec}: no file {path.resolve()}; give the path of your .py file")
        loader_spec = importlib.util.spec_from_file_location(f"fitlm_user_rewards_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise RewardError(f"{spec}: {path} cannot be imported as Python")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise RewardError(f"{spec}: cannot import {module_name!r} ({e}); install it or give a .py path") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"{spec}: {module_name} has no function {attr!r}")
    return fn


def load_rewards(specs: list[str]) -> list[Reward]:
    """The reward functions finetune.grpo.reward_funcs names, in order."""
    loaded = []
    for spec in specs:
        name, _, param = spec.partition(":")
        fn = builtin(name, param or None) if name in BUILTINS else user_function(spec)
        loaded.append(Reward(spec, fn))
    return loaded


def call_one(reward: Reward, prompts: list, completions: list[str], columns: dict[str, list]) -> list[float]:
    """One function's rewards for the batch, NaN for None; an error names the function and the prompt."""
    try:
        values = list(reward.fn(prompts=prompts, completions=completions, **columns))
    except Exception as e:
        row = failing_row(reward, prompts, completions, columns)
        raise RewardError(f"reward function {reward.name} failed on the prompt {prompts[row]!r}: {e!r}") from e
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {reward.name} returned {len(values)} rewards for {len(completions)} completions "
            f"(the batch's first prompt: {prompts[0]!r}); return one float or None per completion"
        )
    out = []
    for i, v in enumerate(values):
        if v is not None and not isinstance(v, (int, float)):
            raise RewardError(
                f"reward function {reward.name} returned {v!r} for the prompt {prompts[i]!r}; a reward is a "
                "float or None"
            )
        out.append(float("nan") if v is None else float(v))
    return out


def failing_row(reward: Reward, prompts: list, completions: list[str], columns: dict[str, list]) -> int:
    """The first row the function raises on alone (0 when every row alone passes): the prompt to report."""
    for i in range(len(completions)):
        try:
            reward.fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **slice_columns(columns, i))
        except Exception:
            return i
    return 0


def slice_columns(columns: dict[str, list], i: int) -> dict[str, list]:
    return {k: v[i : i + 1] for k, v in columns.items()}


def score(rewards: list[Reward], prompts: list, completions: list[str], columns: dict[str, list]) -> torch.Tensor:
    """Every function's rewards for the batch, [B, F] float32, NaN where a function returned None."""
    per_func = [call_one(r, prompts, completions, columns) for r in rewards]
    return torch.tensor(per_func, dtype=torch.float32).T.reshape(len(completions), len(rewards))


def total_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each completion's rewards ignoring None (NaN): per_func [B, F], weights [F] -> [B]; NaN
    where every function returned None (unscorable: out of the group baselines and the logged means)."""
    total = (per_func * weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)  # [B]
    return total.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))


__all__ = ["BUILTINS", "Reward", "RewardError", "final_answer", "load_rewards", "score", "total_rewards"]
