"""How a benchmark ends the processes it started: asked to stop, then killed if they linger."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable
from typing import Any

POLL_SECONDS = 0.5  # how often a wait for a child looks whether it still lives


def end_children(stop: Any, procs: Iterable[Any], timeout: float = 30.0) -> None:
    """Set `stop`, wait up to `timeout` s for the processes all together (not each in turn),
    and kill whichever is still alive. A run cut short (an error, SIGTERM, Ctrl-C) passes a
    short `timeout`: a child mid-start does not look at `stop` until it has started."""
    stop.set()
    procs = list(procs)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


class ChildDied(RuntimeError):
    """A benchmark's child process ended before it said it was ready."""

    code = "bench_child_died"


def await_ready(ready: Any, procs: Iterable[Any], what: str, timeout: float) -> Any:
    """What the next child puts on `ready` (the `what` it waits for), waiting at most `timeout`
    s and no longer than `procs` live: one failing first (its traceback already on stderr), or
    all ending with nothing said, ends the wait with ChildDied rather than its whole timeout."""
    watched = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ready.get(timeout=min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            pass
        # a child that answered may have ended cleanly since; one that failed, or all ended
        # with nothing more said, will never answer
        failed = [p.exitcode for p in watched if p.exitcode not in (None, 0)]
        if not failed and watched and all(p.exitcode is not None for p in watched):
            try:
                return ready.get(timeout=POLL_SECONDS)
            except queue.Empty:
                failed = [0]
        if failed:
            raise ChildDied(f"a child process exited with code {failed[0]} while the bench "
                            f"waited for the {what} (its error is above)")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the {what} was not ready in {timeout:g} s")
