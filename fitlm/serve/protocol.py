"""OpenAI's request and response shapes for /v1/chat/completions and /v1/completions.

Requests are checked field by field here rather than by a pydantic model, so that each problem is
one OpenAI-style error naming the parameter (`param`) and the fix, and types are not coerced ("5"
is not a number, true is not 1). Fields OpenAI defines but fitlm does not implement are accepted at
their neutral value (penalties 0, no tools, ...) and refused otherwise; names OpenAI does not define are
refused, as OpenAI refuses them. What evaluation tools send is implemented as vLLM's server does it:
`logprobs` / `top_logprobs`, `echo` (with `max_tokens` 0 to score a prompt only), `n` and `best_of`,
`logit_bias`, and a completion `prompt` that is a text, a list of texts, token ids or a list of token-id lists.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
MAX_STOPS = 4
MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows (OpenAI: 5 for completions, 20 for chat)
MAX_N = 16  # completions per prompt (n, best_of)
# Known fields that are accepted only at these neutral values.
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "suffix": (None,),
    "tools": (None,),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
}
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Params:
    """A validated request: the prompt (messages or text) and the sampling settings."""

    model: str | None
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    messages: list[dict[str, str]] | None = None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: one choice group per prompt
    n: int = 1
    best_of: int = 1  # candidates per prompt; the n with the highest log-probability are returned
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before each completion
    logprobs: int | None = None  # each token's log-probability with this many alternatives (None: not asked)
    logit_bias: dict[int, float] = field(default_factory=dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise APIError(f'{name} must be a number, got {v!r}; e.g. "{name}": {default}', name)
    if not (lo < v if lo_open else lo <= v) or v > hi:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise APIError(f"{name} {v!r} is out of range: it must be in {span}", name)
    return float(v)


def _max_tokens(body: dict) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = body.get(name)
    if v is None:
        return None
    if _is_int(v) and v == 0 and body.get("echo") is True:
        return 0  # score the prompt only (echo with logprobs), as evaluation tools ask
    if not _is_int(v) or v < 1:
        raise APIError(
            f"{name} must be a whole number >= 1 (the most tokens to generate; 0 only with echo), got {v!r}", name
        )
    return v


def _count(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise APIError(f"{name} must be a whole number in [{lo}, {hi}], got {v!r}", name)
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives per token to report, or None: completions' `logprobs` is that count; chat's is a flag
    with the count in `top_logprobs`."""
    if not chat:
        return None if body.get("logprobs") is None else _count(body, "logprobs", 0, 0, MAX_LOGPROBS)
    flag = body.get("logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise APIError(f"logprobs must be true or false, got {flag!r}; the count goes in top_logprobs", "logprobs")
    top = _count(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if body.get("top_logprobs") is not None and not flag:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    return top if flag else None


def _logit_bias(body: dict) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    ok = isinstance(v, dict) and all(isinstance(k, str) and k.isdigit() and _is_number(b) for k, b in v.items())
    if not ok or any(not -100 <= b <= 100 for b in v.values()):
        raise APIError(
            f'logit_bias must map token ids to numbers in [-100, 100], e.g. {{"50256": -100}}, got {v!r:.80}',
            "logit_bias",
        )
    return {int(k): float(b) for k, b in v.items()}


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise APIError(f"stop must be a string or a list of at most {MAX_STOPS} strings, got {v!r}", "stop")
    return [s for s in stops if s]


def _content(m: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts joined."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c
    ):
        return "".join(p["text"] for p in c)
    raise APIError(
        f"messages[{i}].content must be a string or a list of text parts "
        f'([{{"type": "text", "text": ...}}]); fitlm serves text only',
        f"messages[{i}].content",
    )


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError('messages is required: a non-empty list of {"role", "content"} objects', "messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(
            f'messages must be a non-empty list of {{"role", "content"}} objects, got {msgs!r:.80}', "messages"
        )
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise APIError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
        out.append({"role": m["role"], "content": _content(m, i)})
    return out


def _ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(_is_int(t) and t >= 0 for t in p)


def _prompts(body: dict) -> list[str | list[int]]:
    """A text, a list of texts, token ids, or a list of token-id lists: always a list of prompts."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and _ids(p):
        return [list(p)]
    if isinstance(p, list) and p and all(isinstance(x, str) or _ids(x) for x in p):
        return list(p)
    raise APIError(
        f"prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, got {p!r:.80}",
        "prompt",
    )


def _choices(body: dict, stream: bool) -> tuple[int, int]:
    """(n, best_of): completions per prompt, and the candidates they are the best of."""
    n = _count(body, "n", 1, 1, MAX_N)
    best_of = _count(body, "best_of", n, 1, MAX_N)
    if best_of < n:
        raise APIError(f"best_of {best_of} must be at least n ({n}): the n best of best_of candidates", "best_of")
    if stream and best_of > n:
        raise APIError("best_of above n cannot be streamed (the best are known only at the end)", "best_of")
    return n, best_of


def parse(body: Any, chat: bool) -> Params:
    """Validate a request body; raise APIError naming the first bad parameter."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", None)
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            raise APIError(f"Unrecognized request argument supplied: {name}; remove it", name)
    for name, allowed in NEUTRAL.items():
        v = body.get(name)
        if name in known and v not in allowed and not (name == "logit_bias" and v == {}):
            raise APIError(
                f"{name}={v!r} is not supported by fitlm serve; leave it out "
                f"(supported: {' or '.join(repr(a) for a in allowed if a is not None) or 'null'})",
                name,
            )
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError('response_format: only {"type": "text"} is supported; leave it out', "response_format")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"model must be a string, got {model!r}", "model")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise APIError(f"stream must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise APIError(f'stream_options must be {{"include_usage": true|false}}, got {opts!r}', "stream_options")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError(f"seed must be a whole number, got {seed!r}", "seed")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError("user must be a string", "user")
    echo = body.get("echo", False)
    if echo is not None and not isinstance(echo, bool):
        raise APIError(f"echo must be true or false, got {echo!r}", "echo")
    n, best_of = _choices(body, bool(stream))
    return Params(
        model=model,
        max_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        stop=_stop(body),
        seed=seed,
        stream=bool(stream),
        include_usage=bool(opts.get("include_usage", False)),
        messages=_messages(body) if chat else None,
        prompts=[] if chat else _prompts(body),
        n=n,
        best_of=best_of,
        echo=bool(echo),
        logprobs=_logprobs(body, chat),
        logit_bias=_logit_bias(body),
    )


def check_length(prompt_tokens: int, max_tokens: int | None, context: int, where: str) -> int:
    """The max_tokens to run with: the request's, or what the context leaves; APIError if it does not fit."""
    room = context - prompt_tokens
    if room < 1:
        raise APIError(
            f"the {where} has {prompt_tokens} tokens but the model's context is {context} tokens "
            f"(with at least 1 to generate); shorten the {where}",
            where,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(
            f"max_tokens {max_tokens} plus the {prompt_tokens}-token {where} exceeds the model's context of "
            f"{context} tokens; ask for at most {room} tokens, or shorten the {where}",
            "max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


__all__ = ["APIError", "Params", "check_length", "new_id", "parse"]
