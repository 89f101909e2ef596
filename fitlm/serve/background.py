"""uvicorn in a background thread on a free loopback port: for tests, benchmarks and notebooks.

`fitlm serve` runs uvicorn in the main thread (it handles SIGTERM there); this is the same server,
started beside other work in one process and stopped by leaving the `with` block.
"""

from __future__ import annotations

import threading
import time


class ServerThread:
    """`with ServerThread(create_app(...)) as s:` serves at `s.url` (.../v1) until the block ends."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        from fitlm.serve.cli import bind_socket

        self.sock = bind_socket(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="fitlm-serve-http"
        )

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        for _ in range(600):  # start-up takes well under a second; give up after 30 s
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            time.sleep(0.05)
        self.sock.close()
        raise RuntimeError("uvicorn did not start serving")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


__all__ = ["ServerThread"]
