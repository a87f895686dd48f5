"""What a sandboxed process does, as Linux tells it without polling: its exit (a pidfd) and each
write to its output file (inotify), one file descriptor each to wait on with `select`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import time
from pathlib import Path

_IN_MODIFY = 0x2
_libc: ctypes.CDLL | None = None


def _inotify_fd(path: Path) -> int | None:
    """An inotify descriptor readable after each write to `path`; None where there is none."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fd = int(_libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    if int(_libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY)) < 0:
        os.close(fd)
        return None
    return fd


class ProcessEvents:
    """A process's exit and its output file's writes. `wait` blocks until one of them happens:
    "exited" (it stays so), "output" (once for what was written since the last), or None when
    `timeout` seconds passed first. Without pidfds (Linux < 5.3) `wait` says None each time and
    the agent's own round finds the exit."""

    def __init__(self, pid: int, output: Path) -> None:
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._pidfd = None
        self._inotify = _inotify_fd(output)

    def wait(self, timeout: float) -> str | None:
        fds = [fd for fd in (self._pidfd, self._inotify) if fd is not None]
        if not fds:
            time.sleep(timeout)
            return None
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError):  # closed under us: the workload was forgotten
            return "exited"
        if self._pidfd is not None and self._pidfd in ready:
            return "exited"
        if self._inotify is not None and self._inotify in ready:
            with contextlib.suppress(OSError):
                while os.read(self._inotify, 4096):  # what woke us, all of it
                    pass
            return "output"
        return None

    def close(self) -> None:
        for fd in (self._pidfd, self._inotify):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._pidfd = self._inotify = None
