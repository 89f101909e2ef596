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
from fitlm.serve.choices import RequestRun, thread_emitter
from fitlm.serve.engine import Engine, Event, GenRequest
from fitlm.serve.model import ServedModel

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


def _error(e: protocol.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def events(engine: Engine, req_args: dict) -> tuple[GenRequest, asyncio.Queue]:
    q: asyncio.Queue[Event] = asyncio.Queue()
    req = GenRequest(emit=thread_emitter(q), **req_args)
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
        prompts = _prompt_ids(served, p, chat)
        where = "messages" if chat else "prompt"
        max_tokens = [_room(len(ids), p.max_tokens, served.context, where) for ids in prompts]
        _check_bias(p.logit_bias, cast(ModelConfig, served.model.config).vocab_size)
        run = RequestRun(served, engine, p, prompts, chat)
        try:
            await run.start(max_tokens)
        except BaseException:
            run.cancel()
            raise
        rid = protocol.new_id(chat)
        if p.stream:
            return StreamingResponse(
                _sse(run, rid), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            if not await run.wait(request.is_disconnected, DISCONNECT_POLL_S):
                return JSONResponse({}, status_code=499)  # the client went away: nobody reads it
            return run.whole(rid)
        finally:
            run.cancel()  # frees the slots when this handler is cancelled

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    return app


def _prompt_ids(served: ServedModel, p: protocol.Params, chat: bool) -> list[list[int]]:
    """The request's prompts as token ids: the conversation through the chat template, a prompt's text encoded
    as `fitlm generate` encodes it, or its token ids taken as given (no BOS added) and checked against the
    vocabulary."""
    # (served.model.config: a fitlm model's ModelConfig, which nn.Module's __getattr__ types as Tensor | Module)
    vocab = cast(ModelConfig, served.model.config).vocab_size
    try:
        if chat:
            return [served.chat_ids(cast(list[dict[str, str]], p.messages))]  # (parse requires messages)
        out = [list(x) if isinstance(x, list) else served.text_ids(x) for x in p.prompts]
    except DataError as e:  # the chat template refused the conversation (raise_exception, ...)
        raise protocol.APIError(str(e), "messages" if chat else "prompt") from None
    for i, ids in enumerate(out):
        if not ids:
            raise protocol.APIError(f"prompt {i} encodes to no tokens; give some text or token ids", "prompt")
        if max(ids) >= vocab:
            raise protocol.APIError(
                f"prompt {i} holds token id {max(ids)} but the vocabulary has {vocab} ids", "prompt"
            )
    return out


def _room(n_prompt: int, max_tokens: int | None, context: int, where: str) -> int:
    """The tokens to generate for one prompt (0: echo scores the prompt only, which must fit the context)."""
    if max_tokens == 0:
        if n_prompt > context:
            raise protocol.APIError(
                f"the {where} has {n_prompt} tokens but the model's context is {context} tokens; shorten it",
                where,
                code="context_length_exceeded",
            )
        return 0
    return protocol.check_length(n_prompt, max_tokens, context, where)


def _check_bias(bias: dict[int, float], vocab: int) -> None:
    outside = [t for t in bias if t >= vocab]
    if outside:
        raise protocol.APIError(
            f"logit_bias names token id {outside[0]} but the vocabulary has {vocab} ids", "logit_bias"
        )


async def _sse(run: RequestRun, rid: str) -> AsyncIterator[str]:
    """A streamed reply: OpenAI's chunks as server-sent events, then `data: [DONE]`."""

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        async for obj in run.stream(rid):
            yield sse(obj)
    except protocol.APIError as e:
        yield sse(e.body())
    finally:
        run.cancel()  # the client went away (Starlette cancels the generator): free the slots
    yield "data: [DONE]\n\n"


__all__ = ["create_app", "events"]
