"""Serve errors: ValueError subclasses, so the CLI prints them as one fixable paragraph (exit 2)."""

from __future__ import annotations

import importlib.util


class ServeError(ValueError):
    """A server that cannot start as asked (port taken, server packages missing, ...)."""


def require_server_packages(command: str = "fitlm serve", extra: str = "serve") -> None:
    """Refuse early, naming the extra to install, when FastAPI or uvicorn is missing."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeError(
            f"{command} needs {' and '.join(missing)}, which are not installed; "
            f"install them with `pip install -e '.[{extra}]'` (or `pip install fastapi uvicorn`)"
        )


__all__ = ["ServeError", "require_server_packages"]
