"""Docker jobs started with `stdin`: the engine's attach stream of a container's stdin, held by
the agent for `pool lease attach -i`. Closing it is the job's end of input, for good."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from agents.runtimes.stdin import StdinClosed


class DockerStdin:
    """The stdin streams by workload key, the same calls as StdinPipes. The container is made
    with OpenStdin and StdinOnce, and attached to (stdin only) before it starts: the engine
    closes its stdin when this stream ends. An agent that restarts loses them, and the engine
    sees its end, so the job's reads end, as a terminal's would when it goes."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[Any, socket.socket]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def open(self, key: str, api: Any, container_id: str) -> None:
        """Attach to the (created, not yet started) container's stdin and keep the stream."""
        raw = api.attach_socket(container_id, params={"stdin": 1, "stream": 1})
        sock = getattr(raw, "_sock", raw)  # the hijacked connection under the SDK's wrapper
        with self._lock:
            old = self._streams.pop(key, None)
            self._streams[key] = (raw, sock)
            self._locks[key] = threading.Lock()
        if old is not None:
            _shut(*old)

    def write(self, key: str, data: bytes) -> None:
        """All of `data` to the job's stdin, waiting while the engine takes no more (the
        session that writes waits, and its tenant with it); StdinClosed without one."""
        with self._lock:
            stream, lock = self._streams.get(key), self._locks.get(key)
        if stream is None or lock is None:
            raise StdinClosed("the job has no stdin: start it with --stdin (and it was not "
                              "closed by an end of input)")
        with lock:
            try:
                stream[1].sendall(data)
            except OSError as e:  # the container's stream ended: it exited
                raise StdinClosed(f"the job's stdin is closed: {e.strerror or e}") from e

    def close(self, key: str) -> None:
        """The end of the job's input: the stream's write half ends, then the stream."""
        with self._lock:
            stream = self._streams.pop(key, None)
            self._locks.pop(key, None)
        if stream is not None:
            _shut(*stream)


def _shut(raw: Any, sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    with contextlib.suppress(Exception):
        raw.close()
    with contextlib.suppress(OSError):
        sock.close()
