"""Which engine runs `fitlm data clean|tokenizer|pack`: "local" (this process and its worker processes,
no extra dependency; the default) or "ray" (Ray Data: the local machine by default, a cluster by address).

Why Ray Data: it is what large LLM data pipelines run on today, it streams blocks through the object
store (spilling to disk) instead of holding a corpus in memory, it runs unchanged on a laptop and on a
cluster, and it installs from PyPI as an optional extra (`pip install 'fitlm[ray]'`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fitlm.data.errors import DataError

ENGINES = ("local", "ray")
RAY_EXTRA = "pip install 'fitlm[ray]'"


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise DataError(f"--engine {engine!r} is not known; use local (default) or ray")


def require_ray() -> Any:
    """The `ray` module, or a DataError naming the extra to install."""
    try:
        import ray
        import ray.data  # noqa: F401  (the Data library is a separate part of the ray package)
    except ImportError as e:
        raise DataError(
            f"--engine ray needs Ray Data, which is not installed ({e}); {RAY_EXTRA} "
            "(or `pip install 'ray[data]'`), or leave out --engine to run on the local engine"
        ) from None
    return ray


@contextmanager
def ray_session(address: str | None = None, show_progress: bool = False) -> Iterator[Any]:
    """A Ray connection: the one this process already has, else a new one to `address` (a cluster,
    e.g. ray://head:10001 or "auto") or, without an address, a local Ray on this machine's CPUs;
    a connection opened here is closed at the end. Results are returned in input order."""
    ray = require_ray()
    started = False
    if not ray.is_initialized():
        address = address or os.environ.get("FITLM_RAY_ADDRESS")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if address and address != "auto":
            _check_reachable(address)
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as e:
            raise DataError(
                f"--ray-address {address!r}: cannot connect to a Ray cluster there ({e}); start one "
                "(`ray start --head`) or leave out --ray-address for a local Ray"
            ) from None
        started = True
    from ray.data.context import ShuffleStrategy

    ctx = ray.data.DataContext.get_current()
    saved = (
        ctx.execution_options.preserve_order,
        ctx.enable_progress_bars,
        ctx.print_on_execution_start,
        ctx.shuffle_strategy,
    )
    ctx.execution_options.preserve_order = True  # outputs in input order: the same files as the local engine
    ctx.enable_progress_bars = show_progress
    ctx.print_on_execution_start = False
    # Group-bys as sort-based shuffles of tasks: the hash shuffle starts aggregator actors, which costs seconds
    # per group-by at any size, and the dedup runs four of them.
    ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    try:
        yield ray
    finally:
        (
            ctx.execution_options.preserve_order,
            ctx.enable_progress_bars,
            ctx.print_on_execution_start,
            ctx.shuffle_strategy,
        ) = saved
        if started:
            ray.shutdown()


def _check_reachable(address: str) -> None:
    """Fail in seconds on an address nothing listens at (ray.init retries for minutes)."""
    import socket

    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise DataError(
            f"--ray-address {address!r}: nothing answers there ({e}); give the head's HOST:PORT "
            "(`ray start --head` prints it) or ray://HOST:10001, or leave out --ray-address for a "
            "local Ray"
        ) from None


def reraise_data_error(e: BaseException) -> None:
    """Ray wraps an exception raised in a task (with the worker's traceback); find a DataError in it
    and raise it plainly, so the CLI prints the one-line message it would print on the local engine."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        cause = getattr(cur, "cause", None)
        if isinstance(cause, DataError) or type(cur) is DataError:
            err = cause if isinstance(cause, DataError) else cur
            # Ray Data appends its retry advice to the message; the user's fix is in the first part.
            message = str(err.args[0]).split("\nFailed to apply UDF", 1)[0] if err.args else ""
            raise DataError(message) from None
        cur = cause if isinstance(cause, BaseException) else (cur.__cause__ or cur.__context__)


__all__ = ["ENGINES", "RAY_EXTRA", "check_engine", "ray_session", "reraise_data_error", "require_ray"]
