"""Serve errors: ValueError subclasses, so the CLI prints them as one fixable paragraph (exit 2)."""

from __future__ import annotations

import importlib.util


class ServeError(ValueError):
    """A server that cannot start as asked (port taken, server packages missing, ...)."""


def require_server_packages() -> None:
    """Refuse early, naming the extra to install, when FastAPI or uvicorn is missing."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeError(
            f"fitlm serve needs {' and '.join(missing)}, which are not installed; "
            "install them with `pip install -e '.[serve]'` (or `pip install fastapi uvicorn`)"
        )


__all__ = ["ServeError", "require_server_packages"]
