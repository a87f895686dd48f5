"""The append signal: wakes an idle log follower when the event stream stores a new event.
Why a one-shot subscription on the republished headers: docs/adr/001-wake-on-append.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from bus.errors import BusError
from bus.runtime import BusRuntime, get_runtime
from bus.subjects import APPENDED_FILTER

log = logging.getLogger(__name__)


class AppendSignal:
    """A wake-up for one worker thread: `arm()`, step once more, then `wait(timeout)`.

    Arming registers interest in the next append with the server (a subscription that ends
    after one message) and returns once the server holds it. An event stored before that
    moment is not signalled, which is why the caller steps once more after arming: that step
    reads it. Republished headers are sent only after the event is stored, so a woken worker
    finds it in the log."""

    def __init__(self, runtime: BusRuntime | str, *, subject: str = APPENDED_FILTER,
                 timeout: float = 5.0) -> None:
        self._rt = get_runtime(runtime) if isinstance(runtime, str) else runtime
        self.subject = subject
        self.timeout = timeout
        self._fired = threading.Event()
        self._armed = False  # a one-shot subscription is held by the server (or being sent)
        self._sub: Any = None
        self.arms = 0  # subscriptions armed, for tests and metrics
        self.wakes = 0  # appends that woke a wait

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> bool:
        """Ask to be woken by the next append. True once the server holds the interest (or
        already did); False if the bus did not answer — the caller then polls."""
        if self._armed:
            return True
        self._fired.clear()
        try:
            self._rt.run(self._arm(), self.timeout + 1.0)
        except BusError as e:
            self._armed = False
            log.debug("append signal on %s not armed: %s", self.subject, e)
            return False
        return True

    async def _arm(self) -> None:
        nc = await self._rt.connection()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.add_done_callback(self._on_append)
        self._armed = True  # before the SUB: its message may come before this coroutine resumes
        try:
            sub = await nc.subscribe(self.subject, future=done, max_msgs=1)
            await sub.unsubscribe(limit=1)  # the server drops the interest after one message
            self._sub = sub
            await nc.flush(max(1, round(self.timeout)))  # the server has processed the SUB once PONG returns
        except BaseException:
            self._armed = False
            done.cancel()
            raise

    def _on_append(self, done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            return
        self._armed = False
        self._sub = None
        self.wakes += 1
        self._fired.set()

    def wait(self, timeout: float) -> bool:
        """Wait until an append (or `wake()`) since the last `arm()`, at most `timeout`
        seconds; True if woken. The interest stays armed after a timeout."""
        woken = self._fired.wait(max(0.0, timeout))
        self._fired.clear()
        return woken

    def wake(self) -> None:
        """Wake a waiting thread now (e.g. to stop)."""
        self._fired.set()

    def close(self) -> None:
        """Drop an armed interest, if the bus still answers; wakes any waiter."""
        self.wake()
        sub, self._sub = self._sub, None
        if sub is None or self._rt.closed:
            return

        async def drop() -> None:
            await sub.unsubscribe()

        try:
            self._rt.run(drop(), self.timeout)
        except Exception as e:  # noqa: BLE001 - best effort: the subscription ends with the connection
            log.debug("append signal on %s: unsubscribe failed: %s", self.subject, e)
        self._armed = False
