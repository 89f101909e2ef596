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

from fastapi import FastAPI, Query, Request
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


async def _body(request: Request) -> dict[str, Any]:
    """The POST's JSON object ({} for anything else: the endpoint then names the field it misses)."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def guard(app: FastAPI, hosts: tuple[str, ...] | None) -> None:
    """What stops another web page from driving this one (it starts processes and writes files): a POST must be
    JSON (a form or text/plain post needs no CORS preflight; JSON does), from this page's own origin, and
    every request must name a Host this server answers to (a rebinding DNS name does not). `hosts` None:
    any host, for an explicit --host on a network address."""

    @app.middleware("http")
    async def same_origin_only(request: Request, call_next):
        host = (request.headers.get("host") or "").rsplit(":", 1)[0].strip("[]")
        if hosts is not None and host not in hosts:
            return JSONResponse({"error": f"Host {host!r} is not this server; open it as http://127.0.0.1"}, 421)
        if request.method == "POST":
            kind = request.headers.get("content-type", "").split(";")[0].strip()
            origin = request.headers.get("origin")
            if kind != "application/json":
                return JSONResponse({"error": "POST bodies must be application/json"}, status_code=415)
            if origin and origin.split("://", 1)[-1] != request.headers.get("host"):
                return JSONResponse({"error": f"requests from {origin} are refused: use the page itself"}, 403)
        return await call_next(request)


def create_app(root: Path, hosts: tuple[str, ...] | None = LOOPBACK) -> FastAPI:
    """The app for RUNS_DIR `root`, answering to the Host names `hosts` (see `guard`); its lifespan closes the
    chat engine and this UI's exports at shutdown."""
    root = root.expanduser().resolve()
    jobs, models = Jobs(root), chat.ChatModels()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(models.close)
        jobs.close()

    app = FastAPI(title="fitlm ui", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.root, app.state.jobs, app.state.models = root, jobs, models
    guard(app, hosts)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    async def home() -> RedirectResponse:
        return RedirectResponse("/plan")

    for page in PAGES:  # one page; its script draws the view the path names
        app.add_api_route(page, lambda: FileResponse(STATIC / "index.html"), methods=["GET"])
    app.add_api_route("/runs/{name:path}", lambda name: FileResponse(STATIC / "index.html"), methods=["GET"])

    plan_routes(app, root)
    run_routes(app, root, jobs)
    chat_routes(app, root, models)
    return app


__all__ = ["create_app"]


def plan_routes(app: FastAPI, root: Path) -> None:
    """The Plan view's endpoints: what the page offers (knobs, devices, scenarios) and the plan itself."""

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


def run_routes(app: FastAPI, root: Path, jobs: Jobs) -> None:
    """The Runs and Export views' endpoints: runs, their metrics and plots, start and stop, export jobs."""

    @app.get("/api/runs")
    async def run_list() -> JSONResponse:
        return await answer(lambda: {"runs": runs.list_runs(root)})

    @app.get("/api/run")
    async def run_detail(name: str) -> JSONResponse:
        return await answer(lambda: runs.detail(root, name))

    @app.get("/api/run/metrics")
    async def run_metrics(name: str, since: int = Query(0, ge=0)) -> JSONResponse:
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
        body = await _body(request)

        def work() -> dict[str, Any]:
            req = planning.PlanRequest.from_json(body)
            resolved = planning.resolve(req)  # validated first: a bad config starts nothing
            return jobs.start_train(resolved.data, str(body.get("name") or "")).as_dict()

        return await answer(work)

    @app.post("/api/run/stop")
    async def run_stop(request: Request) -> JSONResponse:
        body = await _body(request)
        return await answer(lambda: jobs.stop_run(str(body.get("name") or "")))

    @app.get("/api/jobs")
    async def job_list() -> JSONResponse:
        return await answer(lambda: {"jobs": [j.as_dict() for j in jobs.jobs.values()]})

    @app.get("/api/job")
    async def job(id: str) -> JSONResponse:
        return await answer(lambda: jobs.get(id).as_dict())

    @app.post("/api/export")
    async def export(request: Request) -> JSONResponse:
        body = await _body(request)
        return await answer(lambda: jobs.start_export(body).as_dict())


def chat_routes(app: FastAPI, root: Path, models: chat.ChatModels) -> None:
    """The Chat view's endpoints: the models under RUNS_DIR and the streamed reply."""

    @app.get("/api/models")
    async def model_list() -> JSONResponse:
        return await answer(lambda: chat.chat_models(root))

    @app.post("/api/chat")
    async def chat_reply(request: Request):
        body = await _body(request)

        def load() -> tuple:
            req = chat.parse_chat(body)
            served, engine = models.get(req["model"], req["adapter"])
            return req, engine, chat.prompt_ids(served, req)  # a template that fails is a 400 here

        try:
            req, engine, ids = await asyncio.to_thread(load)
        except Exception as exc:  # noqa: BLE001 - as `answer`
            return error_response(exc)
        return StreamingResponse(chat.stream(engine, req, ids), media_type="text/event-stream")
