"""`fitlm ui`: argument parsing and the uvicorn server; the page's work is in app.py and the modules it calls.

It binds 127.0.0.1 unless --host says otherwise: the page starts processes and reads files, so another
address is the user's explicit choice, and it is warned about.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path


def add_commands(sub) -> None:
    p = sub.add_parser(
        "ui",
        help="a local web page: plan memory, start and watch runs, chat with a model, export it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve the fitlm page at http://HOST:PORT: Plan (the planner's per-device memory, fit, "
        "speed, fastest layouts and OOM remedies for a config, model or scenario), Runs (every run under "
        "RUNS_DIR, live charts, start and stop), Chat (streamed, with the model's chat template) and Export "
        "(HF, GGUF, ONNX). Everything is served from the package: it works offline.",
        epilog="examples:\n"
        "  fitlm ui runs                     # http://127.0.0.1:8765\n"
        "  fitlm ui runs --port 0            # any free port (printed)\n"
        "  fitlm ui runs --host 0.0.0.0      # other machines too (a warning: anyone who reaches it can start runs)",
    )
    p.add_argument("runs_dir", nargs="?", default="runs", metavar="RUNS_DIR", help="where runs live (default runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765; 0 = any free port)")
    p.set_defaults(func=cmd_ui)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_ui(args: argparse.Namespace) -> int:
    from fitlm.serve.cli import bind_socket, run_until_sigterm, url
    from fitlm.serve.errors import require_server_packages

    require_server_packages("fitlm ui", "ui")
    import uvicorn

    from fitlm.ui.app import LOOPBACK, create_app

    root = Path(args.runs_dir)
    if root.exists() and not root.is_dir():
        from fitlm.config import ConfigError

        raise ConfigError([f"RUNS_DIR {root} is a file; give a directory (it is created if missing)"])
    root.mkdir(parents=True, exist_ok=True)
    if not _loopback(args.host):
        sys.stderr.write(
            f"fitlm ui: warning: listening on {args.host}, not only on this machine: anyone who can reach it "
            "can start runs, read files under RUNS_DIR and load models. Use --host 127.0.0.1 (the default) "
            "and an SSH tunnel to reach it from elsewhere.\n"
        )
    sock = bind_socket(args.host, args.port)
    # Host names the page answers to: loopback ones, or any where --host is a network address (warned above).
    hosts = None if not _loopback(args.host) else (*LOOPBACK, args.host)
    server = uvicorn.Server(uvicorn.Config(create_app(root, hosts), log_level="warning", timeout_graceful_shutdown=5))
    run_until_sigterm(server, sock, f"fitlm ui: {root.absolute()} at {url(sock)}/\n")
    sys.stderr.write("fitlm ui: stopped\n")
    return 0
