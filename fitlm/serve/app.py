"""The ASGI app of `fitlm serve` (FastAPI): OpenAI's /v1/models, /v1/chat/completions, /v1/completions.

Each completion request is validated and tokenized here (so a bad one is answered 400 before it
queues), then handed to the engine thread with an `emit` that forwards the engine's events into this
request's asyncio queue. Streamed responses are server-sent events in OpenAI's chunk format ending
with `data: [DONE]`. A client that goes away cancels its request, which frees its slot at the next
step: for a stream Starlette cancels the generator; a plain request polls for the disconnect.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fitlm.config import ModelConfig
from fitlm.data.errors import DataError
from fitlm.serve import protocol
from fitlm.serve.engine import Engine, Event, GenRequest
from fitlm.serve.model import ServedModel

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


def _error(e: protocol.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def events(engine: Engine, req_args: dict) -> tuple[GenRequest, asyncio.Queue]:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[Event] = asyncio.Queue()

    def emit(ev: Event) -> None:  # on the engine thread
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:  # the loop is gone (server stopped): nobody is listening
            pass

    req = GenRequest(emit=emit, **req_args)
    engine.submit(req)
    return req, q


def create_app(served: ServedModel, max_batch: int = 8, engine: Engine | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread and, at shutdown, lets it finish what is queued."""
    engine = engine or Engine(served, max_batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="fitlm serve", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(protocol.APIError)
    async def api_error(request: Request, exc: protocol.APIError) -> JSONResponse:
        return _error(exc)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "fitlm",
            "max_model_len": served.context,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "active": engine.active, "queued": engine.queue.qsize()}

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise protocol.APIError(f"the request body is not valid JSON ({e})") from None
        p = protocol.parse(body, chat)
        if p.model is not None and p.model != served.name:
            raise protocol.APIError(
                f"The model `{p.model}` does not exist; this server serves `{served.name}` (GET /v1/models)",
                "model",
                status=404,
                code="model_not_found",
            )
        ids = _prompt_ids(served, p, chat)
        max_tokens = protocol.check_length(len(ids), p.max_tokens, served.context, "messages" if chat else "prompt")
        args = dict(prompt_ids=ids, max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed)
        req, q = await events(engine, {**args, "stop": p.stop})
        rid = protocol.new_id(chat)
        if p.stream:
            return StreamingResponse(
                _stream(served.name, req, q, rid, chat, len(ids), p.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _whole(served.name, request, req, q, rid, chat, len(ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    return app


def _prompt_ids(served: ServedModel, p: protocol.Params, chat: bool) -> list[int]:
    """The request's prompt as token ids: the conversation through the chat template, a prompt's text
    encoded as `fitlm generate` encodes it, or its token ids checked against the vocabulary."""
    try:
        if chat:
            ids = served.chat_ids(cast(list[dict[str, str]], p.messages))  # (parse requires messages)
        else:  # (parse requires a prompt)
            ids = list(p.prompt) if isinstance(p.prompt, list) else served.text_ids(cast(str, p.prompt))
    except DataError as e:  # the chat template refused the conversation (raise_exception, ...)
        raise protocol.APIError(str(e), "messages" if chat else "prompt") from None
    # (served.model.config: a fitlm model's ModelConfig, which nn.Module's __getattr__ types as Tensor | Module)
    vocab = cast(ModelConfig, served.model.config).vocab_size
    if not chat and isinstance(p.prompt, list) and max(ids) >= vocab:
        raise protocol.APIError(f"prompt holds token id {max(ids)} but the vocabulary has {vocab} ids", "prompt")
    return ids


async def _whole(name: str, request: Request, req: GenRequest, q: asyncio.Queue, rid: str, chat: bool, n_prompt: int):
    """A non-streamed reply: the deltas joined, or 499 when the client went away while waiting."""
    pieces: list[str] = []
    try:
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    req.cancel()
                    return JSONResponse({}, status_code=499)  # nobody reads it
                continue
            if ev[0] == "delta":
                pieces.append(ev[1])
            elif ev[0] == "done":
                return protocol.completion(rid, name, chat, "".join(pieces), ev[1], protocol.usage(n_prompt, ev[2]))
            else:
                return _error(protocol.APIError(f"generation failed: {ev[1]}", None, 500, "server_error"))
    finally:
        req.cancel()  # a no-op once done; frees the slot when this handler is cancelled


async def _stream(
    name: str, req: GenRequest, q: asyncio.Queue, rid: str, chat: bool, n_prompt: int, include_usage: bool
) -> AsyncIterator[str]:
    """A streamed reply: OpenAI's chunks as server-sent events, then `data: [DONE]`."""

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if chat:
            yield sse(protocol.chunk(rid, name, chat, None, first=True))
        while True:
            ev = await q.get()
            if ev[0] == "delta":
                yield sse(protocol.chunk(rid, name, chat, ev[1]))
            elif ev[0] == "done":
                yield sse(protocol.chunk(rid, name, chat, None, finish=ev[1]))
                if include_usage:
                    yield sse(protocol.chunk(rid, name, chat, None, use=protocol.usage(n_prompt, ev[2])))
                break
            else:
                err = protocol.APIError(f"generation failed: {ev[1]}", None, 500, "server_error")
                yield sse(err.body())
                break
        yield "data: [DONE]\n\n"
    finally:
        req.cancel()  # the client went away (Starlette cancels the generator): free the slot


__all__ = ["create_app", "events"]
