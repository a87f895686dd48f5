"""Jobs started with `stdin`: a pipe whose read end is the job's stdin and whose write end the
agent holds for `pool lease attach -i`. Closing it is the job's end of input, for good."""

from __future__ import annotations

import contextlib
import os
import threading


class StdinClosed(Exception):
    """The job has no stdin to write to: started without one, or it was closed (an EOF)."""

    code = "stdin_closed"


class StdinPipes:
    """The write ends by workload key. An agent that restarts loses them: its jobs' stdin
    reads end (the pipe has no writer left), as a terminal's would when it goes."""

    def __init__(self) -> None:
        self._writers: dict[str, int] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def open(self, key: str) -> int:
        """A new pipe for `key`: its read end, for the job's stdin (the caller closes it once
        the job has it); the write end is kept here, close-on-exec."""
        r, w = os.pipe2(os.O_CLOEXEC)
        with self._lock:
            old = self._writers.pop(key, None)
            self._writers[key] = w
            self._locks[key] = threading.Lock()
        if old is not None:
            with contextlib.suppress(OSError):
                os.close(old)
        return r

    def write(self, key: str, data: bytes) -> None:
        """All of `data` to the job's stdin, waiting while the job does not read (the session
        that writes waits, and its tenant with it); StdinClosed without one."""
        with self._lock:
            w, lock = self._writers.get(key), self._locks.get(key)
        if w is None or lock is None:
            raise StdinClosed("the job has no stdin: start it with --stdin (and it was not "
                              "closed by an end of input)")
        view = memoryview(data)
        with lock:
            while view:
                try:
                    view = view[os.write(w, view):]
                except OSError as e:  # the job closed its end, or exited
                    raise StdinClosed(f"the job's stdin is closed: {e.strerror}") from e

    def close(self, key: str) -> None:
        """The end of the job's input."""
        with self._lock:
            w = self._writers.pop(key, None)
            self._locks.pop(key, None)
        if w is not None:
            with contextlib.suppress(OSError):
                os.close(w)
