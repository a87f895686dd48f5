"""Serving the gateway: uvicorn in the foreground (`pool gateway`) or on a thread (`pool up`)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def parse_listen(text: str) -> tuple[str, int] | None:
    """`HOST:PORT`, `:PORT` or `PORT` → (host, port); `off` → None. ValueError otherwise."""
    if text.strip().lower() in ("off", "none", "no", "0"):
        return None
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = DEFAULT_HOST, text
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


class ServerThread:
    """uvicorn on a daemon thread with its own loop; `stop()` asks it to finish its requests."""

    def __init__(self, app: Any, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                access_log=False, lifespan="on", timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="pool-gateway", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self.error = e

    @property
    def port(self) -> int:
        for s in self.server.servers:
            for sock in s.sockets:
                return int(sock.getsockname()[1])
        return int(self.server.config.port)

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.error is not None or not self.thread.is_alive():
                # uvicorn exits (SystemExit) when it cannot bind: the usual cause is a port in use
                why = ("cannot listen there; is the port in use?"
                       if isinstance(self.error, SystemExit) else repr(self.error))
                raise RuntimeError(f"the gateway did not start: {why}")
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start in time")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve(app: Any, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """In the foreground until SIGINT/SIGTERM (uvicorn's own handlers)."""
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=3)
