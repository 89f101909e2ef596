"""The decode loop of `fitlm serve`: one background thread owns the model and a `SlotBatch`.

Between two steps it admits queued requests (up to max_batch slots; each prompt is run alone, then
joins the batch), then runs one batched step for all slots and hands each new token to its request.
A request leaves when it ends (stop token, stop string, max_tokens) or was cancelled (its client went
away), freeing its slot for the next in the queue. Requests talk to the HTTP side only through their
`emit` callback, called on this thread (the app forwards it into an asyncio queue).

Why one thread and not the event loop: a step is blocking tensor work; run on the loop it would
stall every connection, while in a thread torch releases the GIL and uvicorn keeps serving.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, cast

import torch

from fitlm.infer.batched import SlotBatch
from fitlm.infer.generate import sample_next
from fitlm.infer.scoring import Choice, choice_at, log_softmax, score_prompts
from fitlm.serve.model import ServedModel
from fitlm.serve.stops import TextStream

# What a request receives: ("delta", text, choices), then ("done", finish_reason, completion_tokens, choices) or
# ("error", message); `choices` are the Choices of the tokens taken since the last event (with logprobs, else []).
# A ScoreJob receives ("scores", [per prompt: [None, Choice, ...]]) or ("error", message).
Event = tuple


@dataclass(eq=False)  # identity: a request is its own slot key
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: none)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits before sampling
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(eq=False)
class ScoreJob:
    """Log-probabilities of whole prompts (echo), run on the engine thread between two steps: the model is only
    ever used by that thread (a step's attention-mask hooks would otherwise reach this forward too)."""

    prompts: list[list[int]]
    top: int
    emit: Callable[[Event], None]


class _Running:
    """A request in a slot: its sampler, text stream and the token to feed next."""

    def __init__(self, req: GenRequest, served: ServedModel):
        self.req = req
        seed = req.seed if req.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator().manual_seed(seed)
        self.text = TextStream(served.tokenizer, req.stop)
        self.count = 0
        self.last = -1
        self.choices: list[Choice] = []  # tokens taken since the last event, with logprobs
        bias = req.logit_bias
        self.bias = (torch.tensor(list(bias)), torch.tensor(list(bias.values()))) if bias else None

    def take(self, logits: torch.Tensor, stop_ids: set[int]) -> str | None:
        """Choose the next token, send its text; return the finish reason when the request is done."""
        scores = logits
        if self.bias is not None:  # OpenAI's logit_bias: added before sampling; logprobs stay the model's
            scores = logits.float().index_add(0, self.bias[0].to(logits.device), self.bias[1].to(logits.device))
        token = sample_next(scores, self.req.temperature, self.req.top_p, self.generator)
        if self.req.logprobs is not None:
            self.choices.append(choice_at(log_softmax(logits), token, self.req.logprobs))
        self.count += 1
        self.last = token
        reason: str | None
        if token in stop_ids:
            reason = "stop"
            piece = self.text.finish()
        else:
            piece, stopped = self.text.push(token)
            reason = "stop" if stopped else ("length" if self.count >= self.req.max_tokens else None)
            if reason == "length":
                piece += self.text.finish()
        if piece:
            self.req.emit(("delta", piece, self.flush()))
        return reason

    def flush(self) -> list[Choice]:
        out, self.choices = self.choices, []
        return out


class Engine:
    """Start with `start()`, queue work with `submit()`; `shutdown()` finishes what is queued, then stops."""

    def __init__(self, served: ServedModel, max_batch: int = 8):
        if max_batch < 1:
            raise ValueError(f"max_batch {max_batch}: at least 1 slot is needed")
        self.served, self.max_batch = served, max_batch
        self.stop_ids = set(served.tokenizer.stop_ids)
        self.queue: queue.Queue[GenRequest | ScoreJob | None] = queue.Queue()
        self.finished: Counter[str] = Counter()  # finish reasons so far, "cancelled" included
        self.active = 0  # requests in slots now (read by tests and /health)
        self.peak_batch = 0
        self._admitting: GenRequest | None = None  # the request joining now (failed with the batch on a bug)
        self._thread = threading.Thread(target=self._run, name="fitlm-serve-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: GenRequest | ScoreJob) -> None:
        self.queue.put(req)

    def shutdown(self, timeout: float | None = None) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        batch = SlotBatch(self.served.model)
        running: dict[GenRequest, _Running] = {}
        closing = False
        while True:
            try:
                closing = self._admit(batch, running, closing)
                if not running:
                    if closing and self.queue.empty():
                        return
                    continue
                # (the batch's keys are the GenRequests this engine added)
                logits = batch.step([running[cast(GenRequest, k)].last for k in batch.keys])
                for key, row in zip(list(batch.keys), logits):
                    slot = running[cast(GenRequest, key)]
                    self._after(batch, running, slot, slot.take(row, self.stop_ids))
            except Exception:  # noqa: BLE001 - a bug: fail the requests in flight, keep serving
                message = traceback.format_exc(limit=4)
                failed = [r.req for r in running.values()]
                if self._admitting is not None and self._admitting not in running:
                    failed.append(self._admitting)  # it failed while joining
                for req in failed:
                    req.emit(("error", message))
                self.finished["error"] += len(failed)
                running.clear()
                batch = SlotBatch(self.served.model)
                self.active, self._admitting = 0, None

    def _admit(self, batch: SlotBatch, running: dict, closing: bool) -> bool:
        """Move queued requests into free slots (waiting for one when nothing runs); drop cancelled ones."""
        for r in [r for r in running.values() if r.req.cancelled.is_set()]:
            self._after(batch, running, r, "cancelled")
        while len(running) < self.max_batch:
            try:
                req = self.queue.get(block=not running and not closing)
            except queue.Empty:
                break
            if req is None:
                closing = True
                continue
            if isinstance(req, ScoreJob):
                self._score(req)
                continue
            if req.cancelled.is_set():
                self.finished["cancelled"] += 1
                continue
            self._admitting = req
            r = _Running(req, self.served)
            logits = batch.add(req, req.prompt_ids, len(req.prompt_ids) + req.max_tokens)
            running[req] = r
            self.active = len(running)
            self.peak_batch = max(self.peak_batch, len(running))
            self._after(batch, running, r, r.take(logits, self.stop_ids))
            self._admitting = None
        return closing

    def _score(self, job: ScoreJob) -> None:
        try:
            job.emit(("scores", score_prompts(self.served.model, job.prompts, job.top)))
        except Exception:  # noqa: BLE001 - a bug: answer the request, keep serving
            job.emit(("error", traceback.format_exc(limit=4)))

    def _after(self, batch: SlotBatch, running: dict, r: _Running, reason: str | None) -> None:
        if reason is None:
            return
        batch.remove(r.req)
        del running[r.req]
        self.active = len(running)
        self.finished[reason] += 1
        if reason != "cancelled":
            r.req.emit(("done", reason, r.count, r.flush()))


__all__ = ["Engine", "Event", "GenRequest", "ScoreJob"]
