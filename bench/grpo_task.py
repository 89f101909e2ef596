"""The synthetic verifiable task of bench/grpo.py: "a + b =" prompts and their two reward functions.

A file of its own so that both contenders load the same functions from it: fitlm by its path
(`finetune.grpo.reward_funcs: [bench/grpo_task.py:closeness, ...]`), TRL as Python callables. TRL's signature:
(prompts, completions, **columns) -> one float per completion.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

TASK = Path(__file__).resolve()
FIRST_NUMBER = re.compile(r"-?\d+")


def first_number(text: str) -> int | None:
    found = FIRST_NUMBER.search(text)
    return int(found.group()) if found else None


def closeness(prompts, completions, answer, **columns) -> list[float]:
    """The reward (TRL's signature, loaded by both contenders): 1 − |first number − answer| / answer, at least 0."""
    out = []
    for text, expected in zip(completions, answer):
        x, want = first_number(text), int(expected)
        out.append(0.0 if x is None else max(0.0, 1.0 - abs(x - want) / want))
    return out


def numeric(prompts, completions, **columns) -> list[float]:
    """The format reward: the share of the completion's non-space characters that are not letters (an answer
    in numbers, " 19 = 19", scores 1; prose, " 3.\n\nThis is a", 2/9)."""
    out = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        out.append(sum(not c.isalpha() for c in chars) / len(chars) if chars else 0.0)
    return out


REWARDS = (closeness, numeric)  # weighted 1 and 1


def make_prompts(seed: int, max_operand: int, held_out: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of {"prompt": "a + b =", "answer": a + b}: every pair once, shuffled by seed."""
    pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a} + {b} =", "answer": a + b} for a, b in pairs]
    return rows[held_out:], rows[:held_out]
