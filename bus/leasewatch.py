"""One lease followed as it happens, for a synchronous caller (the CLI): its feed records and
its job's live output, on the caller's own connection, handed over through a thread-safe queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import Iterator
from typing import Any, Self

from nats.aio.msg import Msg

from bus.errors import BusError, BusTimeout
from bus.feed import FeedFollower
from bus.junk import live_answer
from bus.leaseitems import Change, Output, OutputGate, output_sample
from bus.service import Client
from bus.subjects import output_filter

__all__ = ["Change", "LeaseWatch", "Output"]


class LeaseWatch:
    """Follows one lease on a `Client`'s connection: its feed records after `after` (stored ones
    first, then live, none twice: bus.feed.FeedFollower) and, with `output`, its job's output
    samples as they are published (live only: what was stored before `start` is read with the
    telemetry replay). `start` returns once both are subscribed."""

    def __init__(self, client: Client, tenant: str, lease_id: str, *, output: bool = False,
                 after: int = 0) -> None:
        self._client = client
        self.tenant = tenant
        self.lease_id = lease_id
        self._output = output
        self._after = after
        self._queue: queue.SimpleQueue[Output | Change | BaseException] = queue.SimpleQueue()
        self._task: Any = None
        self._sub: Any = None
        self.live_from = 0.0
        self._gate = OutputGate(self._queue.put)

    def start(self) -> Self:
        # the output stamped from here on (less a minute's slack for the agent's clock) is
        # what may come live; a reader of the stored output counts what it wrote from then
        self.live_from = time.time() - 60
        loop = self._client._loop  # the same package's connection and loop

        async def subscribe() -> None:
            nc = self._client._nc
            if self._output:
                self._sub = await nc.subscribe(output_filter(self.tenant, self.lease_id),
                                               cb=self._on_output)
                await nc.flush(timeout=5)  # the server has it: nothing published after is lost
            # the feed's stored records are replayed first: nothing before this is lost either
            self._task = asyncio.ensure_future(self._follow(nc))

        loop.run(subscribe(), timeout=15)
        return self

    async def _on_output(self, msg: Msg) -> None:
        if live_answer(msg.headers, msg.subject):
            return  # a direct get's answer aimed here: the asker's body, not the job's output
        sample = output_sample(msg.data)
        if sample is not None:
            self._gate.output(msg.subject, Output(*sample))

    async def _follow(self, nc: Any) -> None:
        follower = FeedFollower(nc, self.tenant, lease=self.lease_id, after=self._after)
        items = follower.items()
        try:
            async for item in items:
                if item.record is not None:
                    self._gate.placed(item.record.node_id)
                    self._queue.put(Change(item.seq, item.record))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the caller's thread
            self._queue.put(e if isinstance(e, BusError) else BusError(str(e)))
        finally:
            with contextlib.suppress(Exception):
                await items.aclose()  # type: ignore[attr-defined]  # an async generator

    def get(self, timeout: float | None = None) -> Output | Change | None:
        """The next record or output, waiting up to `timeout` seconds (None: nothing came)."""
        try:
            got = self._queue.get(timeout=timeout) if timeout is None or timeout > 0 \
                else self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(got, BaseException):
            raise got
        return got

    def pending(self) -> Iterator[Output | Change]:
        """What has come already, without waiting."""
        while True:
            got = self.get(0)
            if got is None:
                return
            yield got

    def close(self) -> None:
        async def stop() -> None:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()

        with contextlib.suppress(BusTimeout, RuntimeError):
            self._client._loop.run(stop(), timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
