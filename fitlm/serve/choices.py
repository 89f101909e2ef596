"""One completion request's choices: every prompt's `best_of` candidates decoded by the engine, their events
gathered into one queue, the `n` best kept (by summed log-probability, as OpenAI's best_of), and with `echo`
the prompt's text and scored tokens put before each.

Choice indices are OpenAI's: prompt i's choices are i·n .. i·n + n - 1, so a client that sorts the choices by
index reads them in its prompts' order (lm-evaluation-harness does). Candidate j of a prompt samples with seed
`seed + j`: the same seed gives the same choices, and the n choices of one prompt differ.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fitlm.infer.scoring import Choice
from fitlm.serve import protocol, responses
from fitlm.serve.engine import Engine, Event, GenRequest, ScoreJob
from fitlm.serve.model import ServedModel
from fitlm.serve.responses import Entry, Result


def thread_emitter(q: asyncio.Queue, key: int | None = None) -> Callable[[Event], None]:
    """The `emit` a request hands the engine, called on the decode thread: each event onto `q` through this event
    loop (as (key, event) when `key` is given, so one queue gathers several requests); dropped once the loop is
    gone (the server stopped: nobody is listening)."""
    loop = asyncio.get_running_loop()

    def emit(ev: Event) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev if key is None else (key, ev))
        except RuntimeError:
            pass

    return emit


@dataclass
class Candidate:
    prompt: int  # which prompt
    index: int  # its choice index when streamed (best_of == n); the best-of ranking assigns it otherwise
    pieces: list[str] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    finish: str | None = None
    count: int = 0
    req: GenRequest | None = None

    @property
    def logprob(self) -> float:
        return sum(c.logprob for c in self.choices)


class RequestRun:
    """Submit with `start()`, then read `whole()` or `stream()`; `cancel()` frees every slot it holds."""

    def __init__(self, served: ServedModel, engine: Engine, p: protocol.Params, prompts: list[list[int]], chat: bool):
        self.served, self.engine, self.p, self.prompts, self.chat = served, engine, p, prompts, chat
        self.candidates = [Candidate(i, i * p.n + j) for i in range(len(prompts)) for j in range(p.best_of)]
        self.echoed: list[list[Entry]] = [[(t, None) for t in ids] for ids in prompts]
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def _emitter(self, key: int) -> Callable[[Event], None]:
        return thread_emitter(self.queue, key)

    async def start(self, max_tokens: list[int]) -> None:
        """Score the prompts first when echo asks for their log-probabilities, then queue every candidate."""
        p = self.p
        if p.echo and p.logprobs is not None:
            self.engine.submit(ScoreJob(self.prompts, p.logprobs, self._emitter(-1)))
            _, ev = await self.queue.get()
            if ev[0] != "scores":
                raise protocol.APIError(f"scoring the prompt failed: {ev[1]}", None, 500, "server_error")
            self.echoed = [list(zip(ids, s)) for ids, s in zip(self.prompts, ev[1])]
        # best_of > n ranks candidates by log-probability, so they carry one even when the client did not ask.
        report = p.logprobs if p.logprobs is not None else (0 if p.best_of > p.n else None)
        for k, c in enumerate(self.candidates):
            if max_tokens[c.prompt] == 0:  # echo alone: nothing to generate
                c.finish = "length"
                continue
            j = k % p.best_of
            c.req = GenRequest(
                prompt_ids=self.prompts[c.prompt],
                max_tokens=max_tokens[c.prompt],
                emit=self._emitter(k),
                temperature=p.temperature,
                top_p=p.top_p,
                seed=None if p.seed is None else p.seed + j,
                stop=p.stop,
                logprobs=report,
                logit_bias=p.logit_bias,
            )
            self.engine.submit(c.req)

    def cancel(self) -> None:
        for c in self.candidates:
            if c.req is not None:
                c.req.cancel()  # a no-op once done

    def _take(self, k: int, ev: Event) -> Candidate:
        """Apply one engine event to its candidate (an error event raises the 500 it becomes)."""
        c = self.candidates[k]
        if ev[0] == "delta":
            c.pieces.append(ev[1])
            c.choices += ev[2]
        elif ev[0] == "done":
            c.finish, c.count = ev[1], ev[2]
            c.choices += ev[3]
        else:
            raise protocol.APIError(f"generation failed: {ev[1]}", None, 500, "server_error")
        return c

    def _prompt_text(self, i: int) -> str:
        prompt = self.p.prompts[i] if self.p.prompts else None
        return prompt if isinstance(prompt, str) else self.served.tokenizer.decode(self.prompts[i])

    def _result(self, c: Candidate, index: int) -> Result:
        echo = self.p.echo and not self.chat
        text = (self._prompt_text(c.prompt) if echo else "") + "".join(c.pieces)
        entries = None
        if self.p.logprobs is not None:
            entries = (self.echoed[c.prompt] if echo else []) + [(x.token, x) for x in c.choices]
        return Result(index, text, c.finish, entries)

    def _usage(self) -> dict:
        return responses.usage(sum(len(ids) for ids in self.prompts), sum(c.count for c in self.candidates))

    async def wait(self, disconnected: Callable[[], object], poll_s: float) -> bool:
        """Gather events until every candidate is done; False when the client went away first."""
        while any(c.finish is None for c in self.candidates):
            try:
                k, ev = await asyncio.wait_for(self.queue.get(), poll_s)
            except asyncio.TimeoutError:
                if await disconnected():  # type: ignore[misc]  # (Starlette's async is_disconnected)
                    return False
                continue
            self._take(k, ev)
        return True

    def whole(self, rid: str) -> dict:
        """The response once every candidate is done: per prompt the n best (all of them when best_of == n)."""
        p, results = self.p, []
        for i in range(len(self.prompts)):
            group = self.candidates[i * p.best_of : (i + 1) * p.best_of]
            if p.best_of > p.n:
                group = sorted(group, key=lambda c: -c.logprob)[: p.n]
            results += [self._result(c, i * p.n + j) for j, c in enumerate(group)]
        return responses.completion(rid, self.served.name, self.chat, results, self._usage(), self.served.tokenizer)

    async def stream(self, rid: str) -> AsyncIterator[dict]:
        """The chunks of a streamed response (best_of == n): each choice's opening (the role; with echo the
        prompt), its pieces with their tokens, its finish; then usage when asked."""
        name, tok, chat = self.served.name, self.served.tokenizer, self.chat
        sent = [0] * len(self.candidates)  # text offset of each choice's next token
        for c in self.candidates:
            if chat:
                yield responses.chunk(rid, name, chat, Result(c.index, "", None), first=True)
            elif self.p.echo:
                opening = self._result(Candidate(c.prompt, c.index), c.index)
                yield responses.chunk(rid, name, chat, opening, tok=tok)
                sent[c.index] = len(opening.text)
        while any(c.finish is None for c in self.candidates):
            k, ev = await self.queue.get()
            c = self._take(k, ev)
            piece = ev[1] if ev[0] == "delta" else ""
            news = ev[2] if ev[0] == "delta" else ev[3]
            entries = [(x.token, x) for x in news] if self.p.logprobs is not None else None
            if piece or entries:
                yield responses.chunk(rid, name, chat, Result(c.index, piece, None, entries), tok=tok, offset=sent[k])
                sent[k] += len(piece)
            if ev[0] == "done":
                yield responses.chunk(rid, name, chat, Result(c.index, "", c.finish))
        if self.p.include_usage:
            yield responses.chunk(rid, name, chat, None, use=self._usage())


__all__ = ["RequestRun", "thread_emitter"]
