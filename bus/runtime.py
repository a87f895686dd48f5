"""The sync/async bridge: one asyncio event-loop thread per process and server URL, owned by bus/.

Sync callers hand coroutines to `BusRuntime.run`; nats-py errors are translated to bus.errors here.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.connection import connect
from bus.errors import BusError, BusTimeout, BusUnavailable, PublishRejected

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0

log = logging.getLogger(__name__)


def translate(exc: BaseException) -> BaseException:
    """The bus.errors equivalent of a nats-py (or asyncio) exception; others pass through."""
    if isinstance(exc, BusError):
        return exc
    if isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError, TimeoutError)):
        return BusTimeout(f"NATS did not answer in time: {exc!r}")
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return BusUnavailable(f"JetStream unavailable: {exc}")
    if isinstance(exc, nats.js.errors.APIError):
        err = PublishRejected(f"JetStream refused the request: {exc}")
        err.err_code = exc.err_code  # type: ignore[attr-defined]
        err.description = exc.description  # type: ignore[attr-defined]
        return err
    if isinstance(
        exc,
        (
            nats.errors.NoServersError,
            nats.errors.ConnectionClosedError,
            nats.errors.StaleConnectionError,
            nats.errors.OutboundBufferLimitError,
            nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError,
            ConnectionError,
            OSError,
        ),
    ):
        return BusUnavailable(f"NATS unreachable: {exc!r}")
    if isinstance(exc, nats.errors.Error):
        return BusError(f"NATS error: {exc!r}")
    return exc


async def translated(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """`fn(*args)`'s result, its nats-py errors raised as bus.errors (as BusRuntime.run does).
    The coroutine is made here, once this one runs: one refused by a closed runtime (or
    cancelled before it started) leaves none behind never awaited."""
    try:
        return await fn(*args)
    except BaseException as e:
        err = translate(e)
        if err is e:
            raise
        raise err from e


class LoopThread:
    """An asyncio event loop on a daemon thread: the process's one way from sync code to async.

    `run` hands a coroutine to the loop and waits for it (errors come back as raised, untouched);
    any number of threads may call it at once."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(f"{self.thread.name}: run called from its own loop (would deadlock)")
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed (a late call at shutdown): never scheduled
            coro.close()
            raise
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as e:
            fut.cancel()
            raise BusTimeout(f"bus call did not finish within {timeout}s") from e

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def close(self) -> None:
        """Cancel what is left on the loop, then stop it (best effort, bounded)."""

        async def finish() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        if self.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(finish(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run `coro` on the process's shared loop thread (for short-lived, one-off NATS work such
    as admin calls), its nats-py errors translated into bus.errors."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LoopThread("pool-bus")
        loop = _shared
    try:
        return loop.run(coro, timeout)
    except BusError:
        raise
    except BaseException as e:
        translated = translate(e)
        if translated is e:
            raise
        raise translated from e


class BusRuntime:
    """An event loop on a daemon thread holding one nats-py connection to `url`.

    nats-py is not thread-safe, so every use of the connection happens on this loop; any number
    of threads may call `run` concurrently (run_coroutine_threadsafe serialises onto the loop).
    """

    def __init__(self, url: str, *, connect_timeout: float = 5.0) -> None:
        self.url = url
        self._connect_timeout = connect_timeout
        self._loop_thread = LoopThread(f"bus-runtime[{url}]")
        self._loop = self._loop_thread.loop
        self._thread = self._loop_thread.thread
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._closed = False
        self._connect_lock = asyncio.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    async def connection(self) -> Client:
        """The connection, opened on first use (only ever from the loop thread)."""
        if self._nc is not None and not self._nc.is_closed:
            return self._nc
        async with self._connect_lock:
            if self._nc is None or self._nc.is_closed:
                self._nc = await connect(
                    self.url, connect_timeout=self._connect_timeout,
                    # keep reconnecting across a server restart rather than failing every call
                    reconnect_time_wait=0.2,
                    # a large outbound buffer absorbs 1000-message atomic batches
                    pending_size=64 * 1024 * 1024,
                )
                self._js = self._nc.jetstream()
        return self._nc

    async def jetstream(self) -> JetStreamContext:
        await self.connection()
        assert self._js is not None
        return self._js

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = DEFAULT_TIMEOUT) -> T:
        """Run `coro` on the loop and wait; nats errors come back as bus.errors."""
        if self._closed:
            coro.close()
            raise BusUnavailable("bus runtime is closed")
        try:
            return self._loop_thread.run(coro, timeout)
        except BusTimeout:
            raise
        except BaseException as e:
            translated = translate(e)
            if translated is e:
                raise
            raise translated from e

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop; its future. On a closed runtime it raises BusUnavailable
        at once, as `run` does (the stopped loop would never finish the future; whatever is
        in flight when the runtime closes is cancelled by the close)."""
        if self._closed:
            close = getattr(coro, "close", None)
            if close is not None:
                close()
            raise BusUnavailable("bus runtime is closed")
        return self._loop_thread.submit(coro)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _close() -> None:
            if self._nc is not None and not self._nc.is_closed:
                try:
                    await self._nc.drain()
                except Exception:  # noqa: BLE001 - closing is best effort; the server may be gone
                    await self._nc.close()

        with contextlib.suppress(Exception):  # best effort
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
        # nats-py may leave reconnect or flusher tasks behind: the loop thread finishes them
        self._loop_thread.close()


_runtimes: dict[tuple[str, str], BusRuntime] = {}
_runtimes_lock = threading.Lock()


def get_runtime(url: str, name: str = "") -> BusRuntime:
    """The process-wide runtime for `url`, created on first use; a `name` gives a part of the
    process a loop and a connection of its own to the same server."""
    with _runtimes_lock:
        rt = _runtimes.get((url, name))
        if rt is None or rt.closed:
            rt = BusRuntime(url)
            _runtimes[(url, name)] = rt
        return rt


def close_runtime(url: str) -> None:
    """Close every runtime of `url`, whatever its name."""
    with _runtimes_lock:
        rts = [_runtimes.pop(key) for key in list(_runtimes) if key[0] == url]
    for rt in rts:
        rt.close()


@atexit.register
def _close_all() -> None:
    with _runtimes_lock:
        rts = list(_runtimes.values())
        _runtimes.clear()
    for rt in rts:
        rt.close()
