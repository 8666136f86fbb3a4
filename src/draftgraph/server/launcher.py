"""Run the app with uvicorn on a background thread of this process (tests, notebooks)."""

from __future__ import annotations

import asyncio
import threading
import time


class ServerThread:
    """uvicorn serving `app` on host:port (0: a free port) in a daemon thread.

    `start()` returns once the server accepts connections; `base_url` is then known."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.app = app
        self.host = host
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                     timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self

    def drain(self, timeout: float | None = None) -> None:
        """What SIGTERM does to a served app: stop admitting, let running requests finish for
        up to `timeout` seconds (default: the app's --shutdown-timeout), then end the rest."""
        server = self.app.state.server
        loop = server.ae.loop
        if timeout is None:
            timeout = server.config.shutdown_timeout_s
        if loop is None or not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(server.drain(timeout), loop).result(timeout + 10.0)

    def stop(self, timeout: float = 10.0, drain_timeout: float | None = None) -> None:
        """Drain (see `drain`), then stop uvicorn."""
        self.drain(drain_timeout)
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
