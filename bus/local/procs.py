"""Child processes that die with the process that started them (Linux PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's prctl, looked up in the parent: a child between fork and exec must not import
    or load anything (another thread of the parent may have held the import lock at the
    fork). None where there is no such call (not Linux)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child asks for SIGTERM when its parent dies, and exits at once if
    the parent `parent` is already gone (it died between the fork and the prctl)."""

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                os._exit(1)

    return preexec


def child_options() -> dict[str, Any]:
    """Popen keywords for a child that must not outlive this process, whatever ends it
    (SIGKILL included). Only from the main thread: the kernel signals the child when the
    *thread* that forked it ends, and a worker thread may end long before the process."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return {}
    return {"preexec_fn": die_with(os.getpid())}
