"""An attach's input to its job: a bounded buffer per session and a thread of its own that
writes it, so the session keeps serving its tenant while the job does not read."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from agents.runtimes.contract import StdinSink
from bus import sessions as wire

# what one session may have taken and not yet written: the tenant's flow-control window and
# the one frame a client may send past it; a client that ignores its window is refused
STDIN_BUFFER_BYTES = wire.WINDOW_BYTES + wire.CHUNK_BYTES


class StdinFull(Exception):
    """More input than the session's buffer holds while the job does not read it."""

    code = "stdin_full"


class StdinFeed:
    """The session's stdin frames in order, then its end of input; `took(n)` once n bytes are
    in the job's stdin (the session acknowledges them to the tenant only then), `failed(e)`
    when the job's stdin is gone. After the session ends, what it took is still written."""

    def __init__(self, pipes: StdinSink, key: str, took: Callable[[int], None],
                 failed: Callable[[Exception], None], done: threading.Event, name: str) -> None:
        self.pipes, self.key, self.took, self.failed = pipes, key, took, failed
        self.done, self.name = done, name
        self.queued = 0
        self._items: queue.Queue[bytes | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, data: bytes) -> None:
        """Queue `data` for the job; StdinFull past STDIN_BUFFER_BYTES not yet written."""
        with self._lock:
            if self.queued + len(data) > STDIN_BUFFER_BYTES:
                raise StdinFull(f"over {STDIN_BUFFER_BYTES} bytes of input wait for the job "
                                "to read them (send no more than the session's window)")
            self.queued += len(data)
        self._put(data)

    def end(self) -> None:
        """The end of the job's input, after what is queued."""
        self._put(None)

    def _put(self, item: bytes | None) -> None:
        self._items.put(item)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._items.get(timeout=0.5)
            except queue.Empty:
                if self.done.is_set():
                    return
                continue
            if item is None:
                self.pipes.close(self.key)
                continue
            try:
                self.pipes.write(self.key, item)  # waits while the job does not read
            except Exception as e:  # noqa: BLE001 - StdinClosed: the session says so and ends
                self.failed(e)
                return
            with self._lock:
                self.queued -= len(item)
            self.took(len(item))
