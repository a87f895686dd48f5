"""How a worker that follows the log waits when a step found nothing: on the next append.

Shared by the scheduler and the dispatcher; the signal itself lives in bus.appends.
"""

from __future__ import annotations

import threading
from typing import Protocol

# how long an idle follower waits at most without a signal: a safety net for a lost wake-up
# (a reconnect, a server without the republish), not the normal path
FALLBACK_POLL_SECONDS = 0.5
# the old fixed sleep, still used where no signal is given (tests that drive workers by hand)
PLAIN_POLL_SECONDS = 0.05
MIN_WAIT_SECONDS = 0.001


class Signal(Protocol):
    """What IdleWait needs of bus.appends.AppendSignal."""

    @property
    def armed(self) -> bool: ...

    def arm(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...

    def wake(self) -> None: ...


class IdleWait:
    """Call after each step that found nothing to do; returns when the next step is due.

    With a signal: the first idle step arms it and returns at once, so one more step reads
    whatever was stored before the server held the interest; the next idle step waits for an
    append (or `fallback_seconds`, or the caller's own deadline). Without one: a plain sleep."""

    def __init__(self, stop: threading.Event, signal: Signal | None = None, *,
                 fallback_seconds: float | None = None) -> None:
        self.stop = stop
        self.signal = signal
        self.fallback_seconds = (fallback_seconds if fallback_seconds is not None else
                                 FALLBACK_POLL_SECONDS if signal is not None
                                 else PLAIN_POLL_SECONDS)

    def __call__(self, due_in: float | None = None) -> None:
        """Wait for the next step; `due_in` (seconds) bounds the wait, e.g. the next deadline."""
        # a deadline already due is swept by the next step; the floor keeps a clock that
        # disagrees with the deadline (set back, or a test's) from spinning the loop
        timeout = self.fallback_seconds if due_in is None else max(
            MIN_WAIT_SECONDS, min(self.fallback_seconds, due_in))
        signal = self.signal
        if signal is None:
            self.stop.wait(timeout)
            return
        if not signal.armed:
            if signal.arm():
                return  # one more step: it reads what was stored before the interest
            self.stop.wait(timeout)  # the bus did not answer: poll
            return
        signal.wait(timeout)

    def wake(self) -> None:
        """Make a waiting call return now (the caller checks its stop condition next)."""
        if self.signal is not None:
            self.signal.wake()
