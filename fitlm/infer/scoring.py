"""Log-probabilities of given tokens under the model: what `echo` with `logprobs` returns and what
lm-evaluation-harness's loglikelihood requests read.

A prompt is scored by one forward over all its tokens, the training forward (causal attention, positions
0..n-1, the same head and soft cap), so a score is the training loss's number for that token. A request's
prompts share forwards: rows are right-padded to the longest of a group (causal attention never looks right,
so padding changes no real position's logits), and the vocabulary projection runs a slice of positions at a
time, so a long prompt over a large vocabulary never holds [T, V] logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM

ROWS_TOKENS = 8192  # tokens per batched forward (rows × padded length)
LOGIT_POSITIONS = 512  # positions projected onto the vocabulary at once


@dataclass
class Choice:
    """One token as the API reports it: its log-probability and the `top` most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


def choice_at(logprobs: torch.Tensor, token: int, top: int) -> Choice:
    """The Choice of `token` from one position's log-probabilities [V] (fp32). The chosen token's number and the
    top list's come from the same tensor, so a greedy token equals the top's first value exactly (lm-eval
    tests `logprob == max(top)` to call a continuation greedy)."""
    pairs: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
        pairs = list(zip(ids.tolist(), values.tolist()))
    return Choice(token, float(logprobs[token]), pairs)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities in fp32 whatever the model's dtype (a half softmax would round every score)."""
    return torch.log_softmax(logits.float(), dim=-1)


def score_prompts(model: nn.Module, prompts: list[list[int]], top: int) -> list[list[Choice | None]]:
    """For each prompt, one entry per token: None for the first (nothing precedes it), then the Choice of
    token t given tokens < t, with the `top` alternatives."""
    lm = cast("CausalLM", model)  # (a family's model)
    device = next(model.parameters()).device
    out: list[list[Choice | None]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths share a forward
    start = 0
    while start < len(order):
        width = len(prompts[order[start]])
        rows = max(1, ROWS_TOKENS // max(width, 1))
        group = order[start : start + rows]
        start += len(group)
        ids = torch.zeros(len(group), width, dtype=torch.long, device=device)  # [B,T], right-padded
        for r, i in enumerate(group):
            ids[r, : len(prompts[i])] = torch.tensor(prompts[i], device=device)
        with torch.inference_mode():
            h = lm.hidden_states(ids)  # [B,T,C]
            for r, i in enumerate(group):
                out[i] = [None] + _row_choices(lm, h[r], prompts[i], top)
    return out


def _row_choices(lm: "CausalLM", h: torch.Tensor, ids: list[int], top: int) -> list[Choice]:
    """Choices of ids[1:], from hidden states h [T,C] of the row (position t - 1 predicts token t)."""
    choices = []
    for s in range(0, len(ids) - 1, LOGIT_POSITIONS):
        e = min(s + LOGIT_POSITIONS, len(ids) - 1)
        logprobs = log_softmax(lm.logits(h[s:e]))  # [e-s, V]
        choices += [choice_at(logprobs[t - s], ids[t + 1], top) for t in range(s, e)]
    return choices


__all__ = ["Choice", "choice_at", "log_softmax", "score_prompts"]
