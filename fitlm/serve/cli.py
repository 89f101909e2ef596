"""`fitlm serve`: argument parsing and the uvicorn server; the work is in model.py, engine.py and app.py.

The listening socket is bound here (port 0 = any free port) so the printed URL is the real one. On
SIGTERM uvicorn stops accepting connections and waits for the requests in flight, then the app's
lifespan lets the engine finish; uvicorn re-raises the signal after that, which a handler installed
here absorbs, so a drained server exits 0.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys


def batch_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; pass the most requests decoded together, e.g. 8"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: at least 1 request must fit; pass e.g. 8 (1 = one at a time)")
    return n


def add_commands(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (batched, streaming)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve MODEL at http://HOST:PORT/v1 with OpenAI's /v1/models, "
        "/v1/chat/completions (the model's chat template) and /v1/completions; "
        "stream: true sends server-sent events. Concurrent requests are decoded "
        "together, up to --max-batch at a time. SIGTERM finishes the requests in "
        "flight, then exits.",
        epilog="examples:\n"
        "  fitlm serve runs/tour                         # http://127.0.0.1:8000/v1\n"
        "  fitlm serve demo/base --adapter demo/lora/adapter --port 8080 --max-batch 16\n"
        "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' "
        '\\\n    -d \'{"messages": [{"role": "user", "content": "Hi"}], '
        '"max_tokens": 20}\'',
    )
    p.add_argument("model", metavar="MODEL", help="fitlm model dir, training output dir, HF dir or GGUF file")
    p.add_argument("--adapter", metavar="DIR", help="PEFT LoRA adapter to merge into MODEL before serving")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 = any free port)")
    p.add_argument(
        "--max-batch",
        type=batch_size,
        default=8,
        metavar="N",
        help="requests decoded together at most; more wait in a queue (default 8)",
    )
    p.add_argument(
        "--served-name", metavar="NAME", help='the model id clients pass as "model" (default: the last part of MODEL)'
    )
    p.set_defaults(func=cmd_serve)


def bind_socket(host: str, port: int) -> socket.socket:
    from fitlm.serve.errors import ServeError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --port (0 = any free "
            f"port) or stop what is using it"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    from fitlm.serve.errors import require_server_packages

    require_server_packages()
    import uvicorn

    from fitlm.serve.app import create_app
    from fitlm.serve.model import load_served

    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails fast
    served = load_served(args.model, args.adapter, args.served_name)
    config = uvicorn.Config(create_app(served, args.max_batch), log_level="warning", timeout_graceful_shutdown=None)
    banner = (
        f"fitlm serve: {served.name} ({served.path}, template {served.template_name}, context "
        f"{served.context}, max batch {args.max_batch}) at {url(sock)}/v1\n"
    )
    stopped = run_until_sigterm(uvicorn.Server(config), sock, banner)
    sys.stderr.write("fitlm serve: stopped" + (" (SIGTERM: requests in flight finished)\n" if stopped else "\n"))
    return 0


def url(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_until_sigterm(server, sock: socket.socket, banner: str) -> bool:
    """Print `banner` (the URL a client reads), then serve on `sock` until SIGTERM or Ctrl-C; True if SIGTERM.

    The handler is in place before the banner: a SIGTERM sent as soon as the URL is out stops the server
    (it exits once started) instead of killing the process. While uvicorn runs it handles SIGTERM itself
    (drain, shut down) and re-raises it at the end, which this handler absorbs, so a drained server exits 0."""
    stopped: list[int] = []

    def stop(sig, frame) -> None:
        stopped.append(sig)
        server.should_exit = True

    previous = signal.signal(signal.SIGTERM, stop)
    sys.stderr.write(banner)
    sys.stderr.flush()
    try:
        if not stopped:
            server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    return bool(stopped)
