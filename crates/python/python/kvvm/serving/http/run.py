"""Serving the application: :class:`BackgroundServer` runs uvicorn on a thread of the calling
process (tests, benchmarks), on a socket bound before it starts (its port is known at once,
``port=0`` picks a free one)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

__all__ = ["BackgroundServer", "bind"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """uvicorn serving ``app`` on ``host:port`` from a thread; :meth:`start` returns once it
    accepts connections (the app's lifespan has started the engine's loop), :meth:`stop` once
    it has shut down (the loop stopped).

    Args:
        app: the ASGI application (:attr:`OpenAIServer.app <kvvm.serving.http.app.OpenAIServer.app>`).
        host: the address (loopback by default).
        port: the port (0: a free one; :attr:`url` says which).
        start_timeout: seconds :meth:`start` waits for uvicorn.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0) -> None:
        self.sock = bind(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.start_timeout = start_timeout
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> BackgroundServer:
        """Serves on a daemon thread and returns once the server accepts connections (raises
        ``RuntimeError`` if it stopped or did not start within ``start_timeout``)."""
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="kvvm-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Asks the server to exit, waits for its thread (30 s at most) and closes the
        socket; nothing if it is not running."""
        if self._thread is None:
            return
        self.server.should_exit = True
        self._thread.join(30)
        self._thread = None
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
