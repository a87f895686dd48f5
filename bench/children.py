"""How a benchmark ends the processes it started: asked to stop, then killed if they linger."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def end_children(stop: Any, procs: Iterable[Any], timeout: float = 30.0) -> None:
    """Set `stop`, wait up to `timeout` s for each process, and kill whichever is still alive."""
    stop.set()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
