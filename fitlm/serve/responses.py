"""OpenAI's response shapes for /v1/completions and /v1/chat/completions: whole responses, streamed chunks,
usage, and log-probabilities.

Log-probabilities, as OpenAI's (and vLLM's) clients read them:
- completions: `{"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{token: logprob} | null],
  "text_offset": [int]}`, one entry per token of the returned text (with `echo`, the prompt's tokens first; the
  first prompt token has null: nothing precedes it);
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
The numbers are the model's own distribution (fp32 log-softmax of the logits, before temperature, top_p and
logit_bias), the training forward's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fitlm.data.tokenizer import Tokenizer
from fitlm.infer.scoring import Choice

Entry = tuple[int, Choice | None]  # (token id, its Choice; None for a prompt's first token)


@dataclass
class Result:
    """One returned choice: its text (echoed prompt included), finish reason and, when asked, its tokens."""

    index: int
    text: str
    finish: str | None
    entries: list[Entry] | None = None  # None: logprobs not asked


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(tok: Tokenizer, token: int) -> str:
    """A token as text, special tokens spelled out. A token that is part of a character (byte-level BPE splits
    some characters over tokens) has no text of its own: it is written `token_id:N`, as vLLM's
    `return_tokens_as_token_ids` writes every token, so two such tokens never share one `top_logprobs` key."""
    text = tok.decode([token], skip_special_tokens=False)
    return f"token_id:{token}" if not text or "\ufffd" in text else text


def completion_logprobs(tok: Tokenizer, entries: list[Entry], offset: int = 0) -> dict:
    """Completions' log-probabilities; `offset`: the text offset of the first entry in the returned text."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, c in entries:
        text = token_text(tok, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if c is None else c.logprob)
        out["top_logprobs"].append(None if c is None else {token_text(tok, t): lp for t, lp in c.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tok: Tokenizer, entries: list[Entry]) -> dict:
    def one(token: int, logprob: float) -> dict:
        text = token_text(tok, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(t, c.logprob), "top_logprobs": [one(a, lp) for a, lp in c.top]} for t, c in entries if c is not None
        ]
    }


def _logprobs(tok: Tokenizer, chat: bool, entries: list[Entry] | None, offset: int = 0) -> dict | None:
    if entries is None:
        return None
    return chat_logprobs(tok, entries) if chat else completion_logprobs(tok, entries, offset)


def completion(rid: str, model: str, chat: bool, results: list[Result], use: dict, tok: Tokenizer) -> dict:
    """The whole (non-streamed) response object, its choices in index order."""
    choices = []
    for r in sorted(results, key=lambda r: r.index):
        body: dict[str, Any] = (
            {"message": {"role": "assistant", "content": r.text}} if chat else {"text": r.text}
        )  # fmt: skip
        logprobs = _logprobs(tok, chat, r.entries)
        choices.append({"index": r.index, **body, "logprobs": logprobs, "finish_reason": r.finish})
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chunk(
    rid: str,
    model: str,
    chat: bool,
    r: Result | None,
    first: bool = False,
    use: dict | None = None,
    tok: Tokenizer | None = None,
    offset: int = 0,
) -> dict:
    """One server-sent event of a streamed response: a piece of choice `r` (its text so far in this event, its
    tokens' log-probabilities), a chat choice's first event (`first`: the role), or the usage chunk (`use`: no
    choices, as OpenAI sends it)."""
    choices: list = []
    if use is None and r is not None:
        logprobs = _logprobs(tok, chat, r.entries, offset) if tok is not None else None
        if chat:
            delta: dict = {"role": "assistant", "content": ""} if first else ({"content": r.text} if r.text else {})
            choices = [{"index": r.index, "delta": delta, "logprobs": logprobs, "finish_reason": r.finish}]
        else:
            choices = [{"index": r.index, "text": r.text, "logprobs": logprobs, "finish_reason": r.finish}]
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out


__all__ = ["Entry", "Result", "chat_logprobs", "chunk", "completion", "completion_logprobs", "token_text", "usage"]
