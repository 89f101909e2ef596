"""The ASGI app of `fitlm ui` (FastAPI): one page (four views) from the package's static files, and JSON endpoints.

Every figure on the page comes from an endpoint below, which calls the library the CLI calls (the planner,
the run lock, metrics.jsonl, the serve engine, `fitlm train` / `fitlm export` as processes). An input the
user can fix is answered 400 with `{"error": message}` (the CLI's one paragraph); anything else 500 with a
short message, its traceback on the server's stderr. The server keeps serving either way.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from fitlm.ui import chat, planning, runs
from fitlm.ui.jobs import Jobs

STATIC = Path(__file__).parent / "static"
PAGES = ("/plan", "/runs", "/chat", "/export")


def _user_error(exc: BaseException) -> bool:
    # fitlm's own error classes (ConfigError, DataError, ...) describe an input the user can fix.
    return isinstance(exc, (ValueError, OSError)) and (
        type(exc).__module__.startswith("fitlm") or isinstance(exc, (FileNotFoundError, PermissionError))
    )


def error_response(exc: BaseException) -> JSONResponse:
    """A user error as 400 with its message; a bug as 500 with a short message (its traceback on stderr)."""
    if _user_error(exc):
        return JSONResponse({"error": str(exc)}, status_code=400)
    traceback.print_exception(exc, file=sys.stderr)
    return JSONResponse(
        {"error": f"internal error ({type(exc).__name__}: {exc}); the server's log has the traceback"}, status_code=500
    )


async def answer(work: Callable[[], Any]) -> JSONResponse:
    """Run blocking `work` off the event loop; its result as JSON, or its error as `error_response`."""
    try:
        return JSONResponse(await asyncio.to_thread(work))
    except Exception as exc:  # noqa: BLE001 - the page gets a message, never a traceback
        return error_response(exc)


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"{}")
    except ValueError:
        return None


def create_app(root: Path) -> FastAPI:
    """The app for RUNS_DIR `root`; its lifespan closes the chat engine and this UI's exports at shutdown."""
    root = root.expanduser().absolute()
    jobs, models = Jobs(root), chat.ChatModels()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(models.close)
        jobs.close()

    app = FastAPI(title="fitlm ui", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.root, app.state.jobs, app.state.models = root, jobs, models
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    async def home() -> RedirectResponse:
        return RedirectResponse("/plan")

    for page in PAGES:  # one page; its script draws the view the path names
        app.add_api_route(page, lambda: FileResponse(STATIC / "index.html"), methods=["GET"])
    app.add_api_route("/runs/{name:path}", lambda name: FileResponse(STATIC / "index.html"), methods=["GET"])

    @app.get("/api/info")
    async def info() -> JSONResponse:
        return await answer(
            lambda: {
                "runs_dir": str(root),
                "knobs": planning.knob_specs(),
                "devices": planning.devices(),
                "scenarios": planning.scenarios(),
                "scenarios_dir": str(planning.scenarios_dir()),
            }
        )

    @app.post("/api/plan")
    async def plan(request: Request) -> JSONResponse:
        body = await _body(request)
        return await answer(lambda: planning.plan_response(body))

    @app.get("/api/runs")
    async def run_list() -> JSONResponse:
        return await answer(lambda: {"runs": runs.list_runs(root)})

    @app.get("/api/run")
    async def run_detail(name: str) -> JSONResponse:
        return await answer(lambda: runs.detail(root, name))

    @app.get("/api/run/metrics")
    async def run_metrics(name: str, since: int = 0) -> JSONResponse:
        def work() -> dict[str, Any]:
            path = runs.run_dir(root, name)
            records, nxt = runs.read_records(path, since)
            return {"records": records, "next": nxt, "state": runs.state(path)}

        return await answer(work)

    @app.get("/api/run/file")
    async def run_file(name: str, file: str):
        path = runs.run_dir(root, name)
        target = (path / file).resolve()
        if target.parent != path or target.suffix != ".png" or not target.is_file():
            return JSONResponse({"error": f"{file}: not a plot of run {name}"}, status_code=404)
        return FileResponse(target)

    @app.post("/api/run/start")
    async def run_start(request: Request) -> JSONResponse:
        body = await _body(request) or {}

        def work() -> dict[str, Any]:
            req = planning.PlanRequest.from_json(body)
            resolved = planning.resolve(req)  # validated first: a bad config starts nothing
            return jobs.start_train(resolved.data, str(body.get("name") or "")).as_dict()

        return await answer(work)

    @app.post("/api/run/stop")
    async def run_stop(request: Request) -> JSONResponse:
        body = await _body(request) or {}
        return await answer(lambda: jobs.stop_run(str(body.get("name") or "")))

    @app.get("/api/jobs")
    async def job_list() -> JSONResponse:
        return await answer(lambda: {"jobs": [j.as_dict() for j in jobs.jobs.values()]})

    @app.get("/api/job")
    async def job(id: str) -> JSONResponse:
        return await answer(lambda: jobs.get(id).as_dict())

    @app.post("/api/export")
    async def export(request: Request) -> JSONResponse:
        body = await _body(request) or {}
        return await answer(lambda: jobs.start_export(body).as_dict())

    @app.get("/api/models")
    async def model_list() -> JSONResponse:
        return await answer(lambda: chat.chat_models(root))

    @app.post("/api/chat")
    async def chat_reply(request: Request):
        body = await _body(request)

        def load() -> tuple:
            req = chat.parse_chat(body)
            served, engine = models.get(req["model"], req["adapter"])
            return req, served, engine

        try:
            req, served, engine = await asyncio.to_thread(load)
        except Exception as exc:  # noqa: BLE001 - as `answer`
            return error_response(exc)
        return StreamingResponse(chat.stream(served, engine, req), media_type="text/event-stream")

    return app


__all__ = ["create_app"]
