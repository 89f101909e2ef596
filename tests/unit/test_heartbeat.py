"""Heartbeats in a real c10d store (HashStore, TCPStore): the diagnosis names the rank whose heartbeat is stale
or behind, its phase, step and age, this rank's phase and parallel.timeout_s; reading the store is bounded."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fitlm.train.heartbeat import Heartbeat, RankTimeoutError, is_peer_failure

GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
GLOO_RESET = (
    "Read error [127.0.0.1]:32658: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application. Check the logs of the remote worker before reporting an error."
)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def world(store, n: int, clock: Clock, present: int | None = None) -> list[Heartbeat]:
    """Heartbeats of ranks 0..present-1 of an n-rank job (parallel.timeout_s 10, no beat thread: the clock is fake)."""
    return [Heartbeat(store, r, n, 10, clock=clock, beat=False) for r in range(n if present is None else present)]


def test_a_stale_heartbeat_is_named_with_its_phase_step_and_age():
    clock = Clock()
    r0, r1 = world(dist.HashStore(), 2, clock)
    r0.mark("forward/backward", 5)
    r1.mark("forward/backward", 5)
    clock.t += 10.4  # rank 1 is stopped; rank 0's collective gives up after parallel.timeout_s
    msg = r0.diagnosis(RuntimeError(GLOO_TIMEOUT))
    assert "rank 1 stopped responding: its last heartbeat is 10.4 s old, in forward/backward of step 5" in msg
    assert "on rank 0 waited longer than parallel.timeout_s = 10 s in forward/backward of step 5" in msg
    assert "(gloo: Timed out waiting 10000ms for recv operation to complete)" in msg  # source location dropped
    assert "raise parallel.timeout_s" in msg and "py-spy dump" in msg


def test_a_live_rank_that_did_not_reach_this_phase_and_a_missing_one_are_named():
    clock = Clock()
    r0, r1 = world(dist.HashStore(), 3, clock, present=2)  # rank 2 never wrote a record
    r1.mark("evaluation", 100)
    clock.t += 5
    r1.mark("evaluation", 100)  # same phase: no write, `since` stays
    r1.state["beat"] = clock.t  # its beat thread is alive
    r1._write()
    r0.mark("checkpoint save", 100)
    clock.t += 1
    msg = r0.diagnosis(RuntimeError(GLOO_TIMEOUT))
    assert (
        "rank 1 is alive (heartbeat 1.0 s ago) but did not reach this phase: its last one is evaluation of step 100 "
        "(entered 6.0 s ago)" in msg
    )
    assert "rank 2 has no heartbeat in the store" in msg
    assert "in checkpoint save of step 100" in msg


def test_nobody_stale_or_behind_says_so():
    clock = Clock()
    r0, r1 = world(dist.HashStore(), 2, clock)
    for hb in (r0, r1):
        hb.mark("optimizer", 3)
    msg = r0.diagnosis(RuntimeError(GLOO_TIMEOUT))
    assert "no other rank's heartbeat is stale or behind (rank 1 in optimizer of step 3)" in msg


def test_a_closed_connection_reads_as_a_dead_rank():
    clock = Clock()
    r0, r1 = world(dist.HashStore(), 2, clock)
    r1.mark("forward/backward", 18)
    r0.mark("optimizer", 18)
    clock.t += 0.1
    msg = r0.diagnosis(RuntimeError(GLOO_RESET))
    assert msg.startswith(
        "rank 0 lost its connection to another rank in optimizer of step 18 "
        "(gloo: Read error [127.0.0.1]:32658: Connection reset by peer)"
    )
    assert "rank 1 did not reach this phase: its last one is forward/backward of step 18" in msg
    assert "usually died" in msg


def test_a_lost_peer_is_named_with_the_collective_it_died_in(tmp_path, monkeypatch):
    """The dead rank's collective_trace record (what fitlm's launcher collects) joins the paragraph; this
    rank's own record does not."""
    import json

    from fitlm.parallel.collective_trace import TRACE_ENV

    inside = {
        "op": "send/recv",
        "what": "the tied embedding gradient model.embed_tokens.weight",
        "dim": "pp",
        "tensor": "local [256, 64] float32, 65536 bytes",
        "peer": "pp rank 0",
        "inside": True,
    }
    (tmp_path / "rank1.json").write_text(json.dumps(inside))
    (tmp_path / "rank0.json").write_text(json.dumps(dict(inside, what="this rank's own")))
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    clock = Clock()
    r0, r1 = world(dist.HashStore(), 2, clock)
    r0.mark("optimizer", 3)
    msg = r0.diagnosis(RuntimeError(GLOO_RESET))
    assert (
        "Rank 1 was inside send/recv of the tied embedding gradient model.embed_tokens.weight (local [256, 64] "
        "float32, 65536 bytes) over mesh dimension pp with pp rank 0"
    ) in msg
    assert "this rank's own" not in msg


def test_on_timeout_converts_only_peer_failures_and_reads_a_tcp_store_within_bounds():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    hb = Heartbeat(store, 0, 2, 10, beat=False)  # rank 1 never wrote: its key is absent
    hb.mark("data loading", 1)
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match="rank 1 has no heartbeat") as info:
        with hb.on_timeout():
            raise RuntimeError(GLOO_TIMEOUT)
    assert time.monotonic() - start < 2  # a missing key is checked, not waited for
    assert isinstance(info.value, ValueError) and type(info.value).__module__.startswith("fitlm")  # CLI: one paragraph
    assert store.timeout == timedelta(seconds=60)  # the short read timeout is undone
    with pytest.raises(RuntimeError, match="unrelated"), hb.on_timeout():
        raise RuntimeError("unrelated")
    assert is_peer_failure(dist.DistBackendError("NCCL watchdog: Timeout(ms)=1800000 ran for 1800010 ms"))
    assert not is_peer_failure(ValueError("timed out"))


@pytest.mark.process
def test_single_process_is_a_no_op_and_the_beat_thread_refreshes():
    solo = Heartbeat(None, 0, 1, 10)
    solo.mark("data loading", 1)
    with pytest.raises(RuntimeError), solo.on_timeout():  # nothing to diagnose without a store
        raise RuntimeError(GLOO_TIMEOUT)
    store = dist.HashStore()
    hb = Heartbeat(store, 0, 1, 10)  # beats every second
    try:
        first = hb.read()[0]["beat"]
        time.sleep(1.5)
        rec = hb.read()[0]
        assert rec["beat"] > first and rec["phase"] == "startup"
    finally:
        hb.close()


def test_a_large_world_is_summarised_not_listed():
    r0 = world(dist.HashStore(), 20, Clock(), present=1)[0]  # ranks 1..19 never wrote
    msg = r0.diagnosis(RuntimeError(GLOO_TIMEOUT))
    assert "ranks 1, 2, 3, 4, 5, 6, 7, 8 and 11 more have no heartbeat in the store" in msg
