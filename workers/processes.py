"""The scheduler's roles in a child process beside the command responders (`pool up`): its
cycles hold a GIL of their own instead of waiting on the responders'. Why: docs/architecture.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

from workers.bootstrap import PlaneConfig, build, served

log = logging.getLogger(__name__)

# what the child runs; the parent runs the rest of ROLES (commands, and the projector)
CHILD_ROLES = ("scheduler", "reconciler")
PARENT_ROLES = ("commands", "projector")
_CTX = multiprocessing.get_context("spawn")  # the parent holds threads: never fork it


class SchedulerProcessFailed(RuntimeError):
    """The child did not come to serve: it exited first, or took longer than allowed."""

    code = "scheduler_process_failed"


def split_by_default() -> bool:
    """Two processes where there are two cores to run them on."""
    return (os.cpu_count() or 1) >= 2


def _serve(config: PlaneConfig, ready: Any, stop: Any) -> None:
    """The child: CHILD_ROLES until `stop` is set or the parent is gone."""
    # a terminal's Ctrl-C and hang-up reach the whole process group: the parent stops this
    # child through `stop`, after its own roles, so the child ignores them itself; a SIGTERM
    # sent to it alone stops it as cleanly (and the parent starts another)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    told = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: told.set())
    from workers.plane import ControlPlane

    plane = ControlPlane(build(config, served(CHILD_ROLES))).start()
    ready.put(os.getpid())
    parent = multiprocessing.parent_process()
    try:
        while not stop.wait(0.5) and not told.is_set():
            if parent is not None and not parent.is_alive():
                break  # killed without a word: nothing is left to serve for
    finally:
        plane.stop()


class RoleProcess:
    """CHILD_ROLES in a child process: `start()` returns once it serves, `ensure()` starts
    it again if it died, `stop()` stops it (and, past a grace, kills it)."""

    def __init__(self, plane: PlaneConfig | str, *, role_urls: Mapping[str, str] | None = None,
                 responder_url: str | None = None, start_timeout: float = 600.0,
                 metrics_port: int | None = None) -> None:
        # a URL: the config of the child's roles on it, with the other arguments
        config = plane if isinstance(plane, PlaneConfig) else PlaneConfig(
            plane, role_urls=dict(role_urls or {}), responder_url=responder_url,
            metrics_port=metrics_port)
        # passed through the spawn pipe, never on a command line: the URLs hold passwords
        self._args = (config,)
        self.start_timeout = start_timeout
        self._proc: Any = None
        self._stop: Any = None
        self.restarts = 0
        self._retry_at = 0.0
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> RoleProcess:
        self._stop, ready = _CTX.Event(), _CTX.Queue()
        self._proc = _CTX.Process(target=_serve, args=(*self._args, ready, self._stop),
                                  name="pool-scheduler", daemon=True)
        self._proc.start()
        deadline = time.monotonic() + self.start_timeout
        while True:  # its start-up replays the log from its checkpoint: it may take a while
            try:
                ready.get(timeout=0.5)
                return self
            except queue.Empty:
                if not self._proc.is_alive():
                    raise SchedulerProcessFailed(
                        f"the scheduler process exited with code {self._proc.exitcode} "
                        "before it served") from None
                if time.monotonic() > deadline:
                    self._halt(5.0)
                    raise SchedulerProcessFailed(
                        f"the scheduler process did not serve within {self.start_timeout:g} s"
                    ) from None

    def ensure(self) -> bool:
        """Start it again if it died, waiting longer after each failed try (at most a minute);
        True when it serves again."""
        if (self._stopped or self._proc is None or self._proc.is_alive()
                or time.monotonic() < self._retry_at):
            return False
        log.warning("the scheduler process exited with code %s; starting it again",
                    self._proc.exitcode)
        self.restarts += 1
        try:
            self.start()
        except SchedulerProcessFailed as e:
            self._retry_at = time.monotonic() + min(60.0, 2.0 ** min(self.restarts, 6))
            log.error("%s; trying again later", e)
            return False
        self._retry_at = 0.0
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """Stop it for good: `ensure()` starts nothing after this."""
        self._stopped = True
        self._halt(timeout)

    def _halt(self, timeout: float) -> None:
        if self._proc is None:
            return
        if self._stop is not None:
            self._stop.set()
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the scheduler process did not stop within %g s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
