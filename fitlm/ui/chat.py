"""The Chat view: a model loaded as `fitlm serve` loads it, decoded by the serve engine, streamed to the page.

One model (with its adapter) is loaded at a time: picking another shuts the previous engine down once its
requests are done. `template: none` continues the text as `fitlm generate --prompt` does (BOS where the
tokenizer adds one), which is how the page's reply is checked against the CLI's greedy text.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, AsyncIterator

from fitlm.infer.generate import check_sampling
from fitlm.serve.app import events
from fitlm.serve.engine import Engine
from fitlm.serve.model import ServedModel, load_served
from fitlm.ui.errors import UIError

MAX_BATCH = 4
MAX_TOKENS = 4096


class ChatModels:
    """The loaded model and its engine, keyed by (model path, adapter path)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[str, str | None] | None = None
        self._served: ServedModel | None = None
        self._engine: Engine | None = None

    def get(self, model: str, adapter: str | None) -> tuple[ServedModel, Engine]:
        key = (str(Path(model).expanduser()), adapter or None)
        with self._lock:  # two first requests for one model load it once
            if self._key != key or self._engine is None or self._served is None:
                self.close()  # first: two large models need not fit at once
                served = load_served(key[0], key[1])  # a model that does not load raises its user error here
                self._served, self._engine, self._key = served, Engine(served, MAX_BATCH), key
                self._engine.start()
            return self._served, self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown(timeout=60)
        self._engine, self._served, self._key = None, None, None


def parse_chat(body: Any) -> dict[str, Any]:
    """The chat request's fields, checked; UIError naming the field otherwise."""
    if not isinstance(body, dict):
        raise UIError("chat: the request must be a JSON object")
    model = str(body.get("model") or "").strip()
    if not model:
        raise UIError("chat: model: pick a model (a run, a model directory or a GGUF file)")
    messages = body.get("messages")
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("content"), str)
            and m.get("role") in ("system", "user", "assistant")
            for m in messages
        )
    )
    if not ok:
        raise UIError("chat: messages: a list of {role: system|user|assistant, content: text}, ending with yours")
    try:
        temperature, top_p = float(body.get("temperature", 0.0)), float(body.get("top_p", 1.0))
        max_tokens = int(body.get("max_tokens", 128))
        seed = int(body["seed"]) if body.get("seed") not in (None, "") else None
    except (TypeError, ValueError):
        raise UIError("chat: temperature, top_p, max_tokens and seed must be numbers") from None
    check_sampling(temperature, top_p)
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise UIError(f"chat: max_tokens {max_tokens}: give 1 to {MAX_TOKENS}")
    template = body.get("template", "model")
    if template not in ("model", "none"):
        raise UIError("chat: template: `model` (the model's chat template) or `none` (plain continuation)")
    return {
        "model": model,
        "adapter": str(body.get("adapter") or "").strip() or None,
        "messages": messages,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "seed": seed,
        "template": template,
    }


def prompt_ids(served: ServedModel, req: dict[str, Any]) -> list[int]:
    """The prompt's token ids; UIError when they and max_tokens do not fit the model's context."""
    if req["template"] == "none":  # `fitlm generate --prompt`: the last message's text, continued
        ids = served.text_ids(req["messages"][-1]["content"])
    else:
        ids = served.chat_ids(req["messages"])
    if len(ids) + req["max_tokens"] > served.context:
        raise UIError(
            f"chat: the prompt ({len(ids)} tokens) plus max_tokens {req['max_tokens']} exceeds the model's context "
            f"({served.context}); lower max_tokens or start a new chat"
        )
    return ids


async def stream(engine: Engine, req: dict[str, Any], ids: list[int]) -> AsyncIterator[str]:
    """Server-sent events: {"delta": text}... then {"done": reason, "tokens": n} or {"error": message}."""
    gen, q = await events(  # the engine's events for this request, as `fitlm serve` receives them
        engine,
        dict(prompt_ids=ids, max_tokens=req["max_tokens"], temperature=req["temperature"], top_p=req["top_p"],
             seed=req["seed"]),
    )  # fmt: skip
    try:
        while True:
            ev = await q.get()
            if ev[0] == "delta":
                yield _sse({"delta": ev[1]})
            elif ev[0] == "done":
                yield _sse({"done": ev[1], "tokens": ev[2]})
                return
            else:
                yield _sse({"error": "generation failed: " + str(ev[1]).strip().splitlines()[-1]})
                return
    finally:
        gen.cancel()  # the page went away: free the slot


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


SKIP_DIRS = {"checkpoints", "tensorboard", "__pycache__"}


def chat_models(root: Path, depth: int = 4) -> dict[str, list[str]]:
    """What the Chat and Export views offer: model directories (a run's model/ included), GGUF files, adapters."""
    models: list[str] = []
    adapters: list[str] = []

    def walk(d: Path, level: int) -> None:
        try:
            children = sorted(d.iterdir())
        except OSError:
            return
        for p in children:
            if p.name.startswith(".") or p.name in SKIP_DIRS:
                continue
            if p.is_file() and p.suffix == ".gguf":
                models.append(str(p))
            elif p.is_dir() and (p / "adapter_config.json").is_file():
                adapters.append(str(p))
            elif p.is_dir() and any(p.glob("*.safetensors")):
                models.append(str(p))
            elif p.is_dir() and level < depth:
                walk(p, level + 1)

    if root.is_dir():
        walk(root, 1)
    return {"models": models, "adapters": adapters}


__all__ = ["ChatModels", "chat_models", "parse_chat", "stream"]
