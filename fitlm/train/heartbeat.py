"""Heartbeats: which rank stopped responding, and where, when a collective times out.

Each rank records its phase of training ("data loading", "forward/backward", ...), the step and the
time it entered it in the job's c10d store (the default group's, a TCPStore torchrun hosts), when
the phase changes, and a background thread refreshes the record's `beat` time every few seconds, so
a stopped (SIGSTOP, hung in a kernel call, swapping) or dead process shows as a stale heartbeat
while a busy one does not. When a collective fails after `parallel.timeout_s`, `on_timeout` turns
the backend's bare "Timed out waiting 10000ms for recv" into a `RankTimeoutError` naming the rank(s)
whose heartbeat is stale or that never reached this rank's phase, their phase, step and how long ago.

Reading the store after a failure is bounded (a short store timeout, keys checked before they are
read): the diagnosis must not hang where the collective did. A single process has no store: every
method is then a no-op.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

from fitlm.parallel.collective_trace import reports_of_this_job

KEY = "fitlm/heartbeat/{rank}"
# Phases in the order a step passes through them; a rank whose (step, phase) is earlier did not reach ours.
PHASES = (
    "startup",
    "data loading",
    "forward/backward",
    "optimizer",
    "logging",
    "evaluation",
    "checkpoint save",
    "final save",
)
READ_TIMEOUT_S = 5.0  # bound on the store reads made while diagnosing (each one, and all of them together)
MAX_NAMED = 8  # ranks described in the message; the rest are counted
# What gloo (RuntimeError / DistBackendError), nccl with blocking wait and the c10d store say when a peer
# stopped answering ("Timed out waiting 10000ms for recv operation to complete") or died ("Read error
# [127.0.0.1]:32658: Connection reset by peer").
TIMEOUT_MARKS = ("timed out", "timeout")
LOST_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe")


class RankTimeoutError(ValueError):
    """A collective gave up waiting for another rank; the text names it, its phase and what to check."""


def is_peer_failure(exc: BaseException) -> bool:
    """A collective's error that means another rank did not answer in time (or went away)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(mark in text for mark in TIMEOUT_MARKS + LOST_MARKS)


def is_connection_loss(exc: BaseException) -> bool:
    """The peer's end of the connection closed: the rank exited (crash, kill) rather than hung."""
    return any(mark in str(exc).lower() for mark in LOST_MARKS)


def beat_interval(timeout_s: float) -> float:
    """Seconds between liveness beats: a tenth of the timeout, between 1 s and 30 s."""
    return min(30.0, max(1.0, timeout_s / 10))


def position(phase: str, step: int) -> tuple[int, int]:
    """Sortable place in training: (step, phase order); the final save comes after everything."""
    order = PHASES.index(phase) if phase in PHASES else 0
    return (1 << 62 if phase == "final save" else step, order)


class Heartbeat:
    def __init__(
        self,
        store: Any | None,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        clock: Callable[[], float] = time.time,
        beat: bool = True,
    ):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.backend, self.clock = timeout_s, backend, clock
        self.interval = beat_interval(timeout_s)
        self.stale_after = 3 * self.interval  # a live rank beats every interval, whatever its main thread does
        self.state: dict[str, Any] = {"phase": "startup", "step": 0, "since": clock(), "beat": clock()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self._write()
            if beat:
                self._thread = threading.Thread(target=self._beat_loop, name="fitlm-heartbeat", daemon=True)
                self._thread.start()

    @classmethod
    def for_context(cls, ctx, timeout_s: float) -> "Heartbeat":
        """The heartbeat of this rank in the job of `ctx` (a fitlm.parallel.mesh.ParallelContext)."""
        if not ctx.distributed:
            return cls(None, 0, 1, timeout_s)
        import torch.distributed as dist

        return cls(
            dist.distributed_c10d._get_default_store(),
            ctx.rank,
            ctx.world_size,
            timeout_s,
            backend=str(dist.get_backend()),
        )

    # ------------------------------------------------------------------ writing

    def mark(self, phase: str, step: int) -> None:
        """This rank enters `phase` of `step` (one store write, and only when either changed)."""
        if self.store is None or (phase, step) == (self.state["phase"], self.state["step"]):
            return
        now = self.clock()
        with self._lock:
            self.state = {"phase": phase, "step": step, "since": now, "beat": now}
            self._write_locked()

    def close(self) -> None:
        """Stop the liveness beats (before the process group goes away)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + READ_TIMEOUT_S)
            self._thread = None

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self.state = dict(self.state, beat=self.clock())
                try:
                    self._write_locked()
                except Exception:  # noqa: BLE001 - a store that went away: the job is ending anyway
                    return

    def _write(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        assert self.store is not None  # (callers write only with a store)
        self.store.set(KEY.format(rank=self.rank), json.dumps(self.state))

    # ------------------------------------------------------------------ diagnosing

    @contextlib.contextmanager
    def on_timeout(self) -> Iterator[None]:
        """A collective that timed out (or lost its peer) inside the block becomes a RankTimeoutError."""
        try:
            yield
        except RuntimeError as exc:
            if self.store is None or not is_peer_failure(exc):
                raise
            raise RankTimeoutError(self.diagnosis(exc)) from exc

    def read(self) -> dict[int, dict[str, Any] | None]:
        """Every rank's last record (None: it never wrote one, or the reads ran out of their READ_TIMEOUT_S)."""
        out: dict[int, dict[str, Any] | None] = {}
        assert self.store is not None  # (a diagnosis needs the job's store)
        previous = self.store.timeout
        self.store.set_timeout(timedelta(seconds=READ_TIMEOUT_S))
        deadline = time.monotonic() + READ_TIMEOUT_S
        try:
            for r in range(self.world_size):
                key = KEY.format(rank=r)
                try:
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
                except Exception:  # noqa: BLE001 - store unreachable or timed out: nothing known about r
                    out[r] = None
        finally:
            with contextlib.suppress(Exception):
                self.store.set_timeout(previous)
        return out

    def diagnosis(self, exc: BaseException | None = None) -> str:
        """One paragraph: who stopped responding, where, how long ago; this rank's phase; the setting; what to check."""
        now, me = self.clock(), self.state
        lost = exc is not None and is_connection_loss(exc)
        records = self.read()
        mine = position(me["phase"], me["step"])
        suspects, missing = [], []
        for r, rec in records.items():
            if r == self.rank:
                continue
            if rec is None:
                missing.append(r)
                continue
            where = f"{rec['phase']} of step {rec['step']} (entered {now - rec['since']:.1f} s ago)"
            age = now - rec["beat"]
            if age > self.stale_after:
                suspects.append(f"rank {r} stopped responding: its last heartbeat is {age:.1f} s old, in {where}")
            elif position(rec["phase"], rec["step"]) < mine:
                alive = "did not" if lost else f"is alive (heartbeat {age:.1f} s ago) but did not"
                suspects.append(f"rank {r} {alive} reach this phase: its last one is {where}")
        if missing:
            names = ", ".join(map(str, missing[:MAX_NAMED]))
            names += f" and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else ""
            suspects.append(
                f"rank{'s' if len(missing) > 1 else ''} {names} {'have' if len(missing) > 1 else 'has'} no "
                "heartbeat in the store (never reached training, or the store is unreachable)"
            )
        here = f"{me['phase']} of step {me['step']}"
        cause = f" ({self.backend}: {_first_sentence(exc)})" if exc is not None else ""
        if suspects:
            more = f"; and {len(suspects) - MAX_NAMED} more ranks" if len(suspects) > MAX_NAMED else ""
            who = "; ".join(suspects[:MAX_NAMED]) + more
        else:
            others = ", ".join(
                f"rank {r} in {rec['phase']} of step {rec['step']}"
                for r, rec in records.items()
                if r != self.rank and rec
            )
            who = f"no other rank's heartbeat is stale or behind ({others or 'no other rank'}): one of them " + (
                "exited" if lost else "is stuck inside that phase"
            )
        if lost:
            died = "; ".join(reports_of_this_job(self.world_size, skip=self.rank))
            who += f". {died[0].upper()}{died[1:]}" if died else ""
            return (
                f"rank {self.rank} lost its connection to another rank in {here}{cause}. {who}. A rank that closes "
                f"its connection has usually died: torchrun's failure report and that rank's own output give its "
                f"exit code and error (out of host or device memory, killed by a signal, a crash)."
            )
        return (
            f"a collective on rank {self.rank} waited longer than parallel.timeout_s = {self.timeout_s:g} s in "
            f"{here}{cause}. {who}. Check that process: is it alive and not stopped (ps -o pid,stat,cmd; "
            f"py-spy dump --pid PID shows where it is), out of host or device memory, swapping, or waiting on a "
            f"slow filesystem or network. If that phase legitimately takes longer on one rank (a large "
            f"checkpoint or final save, a long evaluation), raise parallel.timeout_s."
        )


def _first_sentence(exc: BaseException) -> str:
    """The backend's message without gloo's source location and advice: "Timed out waiting 10000ms for recv ..."."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    if text.startswith("[") and "] " in text:  # "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out ..."
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0].rstrip(".")[:200]
