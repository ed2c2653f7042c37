"""Serving ASGI apps with uvicorn: in the foreground (the CLI) or in a thread (tests)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import uvicorn

__all__ = ["ServerThread", "free_port", "serve"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _config(app: Any, host: str, port: int, **options: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=options.pop("log_level", "warning"),
        access_log=False,
        timeout_keep_alive=75,
        **options,
    )


class _AnnouncingServer(uvicorn.Server):
    """Calls `on_ready` once the socket is listening, not before."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()


def serve(app: Any, host: str, port: int, on_ready: Callable[[], None] | None = None, **options: Any) -> None:
    _AnnouncingServer(_config(app, host, port, **options), on_ready).run()


class ServerThread:
    """uvicorn on a loopback port in a daemon thread; `url` once started."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(_config(app, self.host, self.port, **options))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
