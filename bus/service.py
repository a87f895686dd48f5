"""Request/reply services on NATS subjects, and the synchronous client that calls them.
The only code that answers NATS requests; handlers run synchronously on worker threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Self, TypeVar

from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import propagate

from bus.connection import connect
from bus.errors import BusTimeout, BusUnavailable, PayloadTooLarge
from bus.objects import FileStore
from bus.replies import RefusedReplies, reply_allowed
from bus.runtime import LoopThread, translate

T = TypeVar("T")
log = logging.getLogger(__name__)

# handler(subject, body, headers) -> reply body
Handler = Callable[[str, bytes, dict[str, str]], bytes]
# the same on the service's loop, or None: "hand it to `Handler` on a worker thread"
FastHandler = Callable[[str, bytes, dict[str, str]], Awaitable[bytes | None]]

INTERNAL_ERROR = json.dumps(
    {"ok": False, "error": {"code": "internal_error", "message": "the service failed", "reasons": {}}}
).encode()
# A request still unanswered after this long is answered `bus_timeout` (the outcome is
# unknown: a retry with the same idempotency key tells) while its worker goes on. Each bus call
# a handler makes has its own timeout, but in a quorum loss several in a row outlasted a
# client's patience, and a client that hears nothing cannot tell a lost request from a slow one.
ANSWER_WITHIN_SECONDS = 25.0


# Requests waiting for a worker or being worked on, at most; one more is refused at once.
MAX_WAITING = 4096
# A gate's refusal (a tenant past its rate) is answered this long after it came, so a client
# flooding in a closed loop waits for its own answers; past MAX_HELD of one key held at
# once (a flood that does not wait for answers), one is answered at once.
HOLD_SECONDS = 1.0
MAX_HELD = 64
# subject -> None to go on, or (key, refusal): checked before anything is decoded
Gate = Callable[[str], "tuple[str, bytes] | None"]


def _timed_out(seconds: float, *, started: bool) -> bytes:
    message = (f"not finished within {seconds:g} s; the outcome is unknown: retry with the "
               "same idempotency key" if started else
               f"no worker was free within {seconds:g} s; the command was not started: retry")
    return json.dumps({"ok": False, "error": {
        "code": "bus_timeout", "message": message,
        "reasons": {"answer_within_seconds": seconds, "started": started}}}).encode()


def _busy(limit: int) -> bytes:
    return json.dumps({"ok": False, "error": {
        "code": "bus_unavailable",
        "message": f"the service already holds {limit} requests; this one was not started: "
                   "retry after a moment",
        "reasons": {"max_waiting": limit}}}).encode()


def _over(limit: int) -> bytes:
    return json.dumps({"ok": False, "error": {
        "code": "concurrency_limit",
        "message": f"{limit} of your requests of this kind are already being answered; "
                   "this one was not started: retry when one is",
        "reasons": {"max_concurrent": limit}}}).encode()


async def _connect(url: str, **options: Any) -> Any:
    return await connect(url, **options)


class Service:
    """Answers requests on `subjects` (queue group `queue`) with `handler`, until `stop()`."""

    def __init__(
        self,
        url: str,
        subjects: list[str],
        handler: Handler,
        *,
        queue: str = "pool-commands",
        threads: int = 8,
        connect_options: dict[str, Any] | None = None,
        fast: FastHandler | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        answer_within_seconds: float = ANSWER_WITHIN_SECONDS,
        max_waiting: int = MAX_WAITING,
        name: str = "pool-cmd",
        per_key: tuple[Callable[[str], str], int] | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.url, self.subjects, self.handler, self.queue = url, subjects, handler, queue
        self.answer_within_seconds, self.max_waiting = answer_within_seconds, max_waiting
        # (key of a subject, limit): at most `limit` requests of one key waiting or worked on
        # (a tenant's reads: one tenant's burst cannot fill the lane), one more refused at once
        self.per_key = per_key
        self._by_key: dict[str, int] = {}
        self.gate, self.hold_seconds = gate, HOLD_SECONDS
        self._held: dict[str, int] = {}
        self._holding: set[asyncio.Future[None]] = set()
        # one request in flight per worker thread, however many subjects deliver them
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._slots: asyncio.Semaphore | None = None
        self._subs: list[Any] = []
        self._in_flight: set[asyncio.Future[None]] = set()
        # `fast` answers on the loop itself; given the loop of the bus runtime its saves go
        # through, a request reaches the group commit without a thread hop
        self.fast = fast
        self._own_loop: LoopThread | None = None
        if loop is None:
            self._own_loop = LoopThread("pool-service")
            loop = self._own_loop.loop
        self._on = loop
        self._nc: Any = None
        self._options = connect_options or {}
        self.handled = 0
        self.refused = RefusedReplies()  # requests whose reply subject is not their inbox

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        if self._own_loop is not None:
            return self._own_loop.run(coro, timeout=timeout)
        return asyncio.run_coroutine_threadsafe(coro, self._on).result(timeout)

    def start(self) -> Service:
        self._run(self._start(), timeout=15)
        return self

    async def _start(self) -> None:
        self._nc = await _connect(self.url, **self._options)
        self._slots = asyncio.Semaphore(self.threads)
        for subject in self.subjects:
            self._subs.append(
                await self._nc.subscribe(subject, queue=self.queue, cb=self._on_msg))
        await self._nc.flush()

    async def _on_msg(self, msg: Any) -> None:
        if not msg.reply:
            return  # a command without a reply subject cannot be answered; nothing is done
        if not reply_allowed(msg.subject, msg.reply):
            # the reply subject is as hostile as the body: outside the requester's own inbox
            # it could be the log, a timer or a work queue, so nothing is done or answered
            self.refused.refuse(msg.subject, msg.reply)
            return
        await self._answer_soon(msg)

    async def _answer_soon(self, msg: Any) -> None:
        """Hand the request to a task at once: nats-py awaits a subscription's callback before
        it delivers that subscription's next message, so waiting here for a free worker would
        let later requests age unseen in its queue. The answer is due `answer_within_seconds`
        after this moment, whether the time went waiting for a worker or working."""
        if self.gate is not None and (refused := self.gate(msg.subject)) is not None:
            await self._hold(msg.reply, *refused)
            return
        if len(self._in_flight) >= self.max_waiting:
            # a flood beyond what the workers can answer in time: refused now, not started
            await self._publish(msg.reply, _busy(self.max_waiting))
            return
        key = None
        if self.per_key is not None:
            key_of, limit = self.per_key
            key = key_of(msg.subject)
            if self._by_key.get(key, 0) >= limit:
                await self._publish(msg.reply, _over(limit))
                return
            self._by_key[key] = self._by_key.get(key, 0) + 1
        task = asyncio.ensure_future(self._answer(msg, self._on.time()))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        if key is not None:
            task.add_done_callback(lambda _: self._release(key))

    async def _hold(self, reply: str, key: str, body: bytes) -> None:
        """Answer `body` HOLD_SECONDS from now; at once when MAX_HELD of `key` are held."""
        if self._held.get(key, 0) >= MAX_HELD:
            await self._publish(reply, body)
            return
        self._held[key] = self._held.get(key, 0) + 1

        async def later() -> None:
            try:
                await asyncio.sleep(self.hold_seconds)
                await self._publish(reply, body)
            finally:
                left = self._held.get(key, 1) - 1
                if left > 0:
                    self._held[key] = left
                else:
                    self._held.pop(key, None)

        task = asyncio.ensure_future(later())
        self._holding.add(task)
        task.add_done_callback(self._holding.discard)

    def _release(self, key: str) -> None:
        left = self._by_key.get(key, 1) - 1
        if left > 0:
            self._by_key[key] = left
        else:
            self._by_key.pop(key, None)

    async def _answer(self, msg: Any, arrived: float) -> None:
        assert self._slots is not None
        loop = asyncio.get_running_loop()
        due = arrived + self.answer_within_seconds
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=max(0.0, due - loop.time()))
        except TimeoutError:
            # every worker stayed busy: the command was never started
            await self._publish(msg.reply, _timed_out(self.answer_within_seconds, started=False))
            return
        try:
            headers = dict(msg.headers or {})
            reply: bytes | None = None
            if self.fast is not None:
                reply = await self._within(self.fast(msg.subject, msg.data, headers), due,
                                           on_error=None)
            if reply is None:
                turn = _Turn(self.handler, msg.subject, msg.data, headers)
                work = loop.run_in_executor(self._pool, turn.run)
                reply = await self._within(work, due, on_error=INTERNAL_ERROR,
                                           turn=turn) or INTERNAL_ERROR
            self.handled += 1
            await self._publish(msg.reply, reply)
        finally:
            self._slots.release()

    async def _within(self, work: Awaitable[bytes | None], due: float,
                      on_error: bytes | None, turn: _Turn | None = None) -> bytes | None:
        """`work`'s answer, or `bus_timeout` once `due` has passed (the work goes on, unheard,
        if its `turn` began; else it never will), or `on_error` when it fails: a handler bug
        must not stop the service."""
        fut = asyncio.ensure_future(work)
        try:
            return await asyncio.wait_for(asyncio.shield(fut),
                                          timeout=max(0.0, due - self._on.time()))
        except TimeoutError:
            fut.add_done_callback(_consumed)
            started = turn is None or turn.began_or_drop()
            return _timed_out(self.answer_within_seconds, started=started)
        except Exception:  # noqa: BLE001 - see the docstring
            return on_error

    async def _publish(self, reply: str, body: bytes) -> None:
        try:
            await self._nc.publish(reply, body)
        except NatsError:
            pass  # the requester is gone; the command's effect (if any) is already durable

    def stop(self) -> None:
        async def _close() -> None:
            if self._nc is not None:
                # no new requests; those taken are answered before the connection goes
                for sub in self._subs:
                    with contextlib.suppress(NatsError):
                        await sub.drain()
                if self._in_flight or self._holding:
                    await asyncio.wait([*self._in_flight, *self._holding], timeout=8)
                await self._nc.drain()

        try:
            if self._on.is_closed():  # the runtime it ran on closed first: so did its connection
                _close().close()
            else:
                self._run(_close(), timeout=10)
        finally:
            if self._own_loop is not None:
                self._own_loop.close()
            self._pool.shutdown(wait=True)


class _Turn:
    """One command's run on a worker thread, which may still be waiting for a free thread
    when its answer is due: then it is dropped, never run, and answered as not started."""

    def __init__(self, handler: Handler,
                 subject: str, body: bytes, headers: dict[str, str]) -> None:
        self._call = (handler, subject, body, headers)
        self._lock = threading.Lock()
        self._began = self._dropped = False

    def run(self) -> bytes | None:
        with self._lock:
            if self._dropped:
                return None
            self._began = True
        handler, subject, body, headers = self._call
        return handler(subject, body, headers)

    def began_or_drop(self) -> bool:
        """Whether the handler began; if not, it never will."""
        with self._lock:
            self._dropped = not self._began
            return self._began


def _consumed(fut: asyncio.Future[Any]) -> None:
    """Read a late worker's outcome, so that its failure is not reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def _traced(headers: dict[str, str] | None) -> dict[str, str] | None:
    """`headers` plus the W3C trace context of the caller's current span, if any; read on the
    caller's thread, where that span is current."""
    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier or None


class Client:
    """A synchronous NATS requester for the CLI and tests: one connection on its own loop."""

    def __init__(self, url: str, **connect_options: Any) -> None:
        self._loop = LoopThread("pool-client")
        self._nc: Any = self._loop.run(_connect(url, **connect_options), timeout=15)

    def request(
        self, subject: str, body: bytes, *, timeout: float = 10.0, headers: dict[str, str] | None = None
    ) -> bytes:
        return self._loop.run(self._go(subject, body, timeout, _traced(headers)),
                              timeout=timeout + 5)

    async def request_async(
        self, subject: str, body: bytes, *, timeout: float = 10.0, headers: dict[str, str] | None = None
    ) -> bytes:
        """`request` for a caller on another event loop (the HTTP gateway): the request runs on
        this client's loop and the caller's loop awaits it without blocking a thread."""
        fut = asyncio.run_coroutine_threadsafe(
            self._go(subject, body, timeout, _traced(headers)), self._loop.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout + 5)
        except TimeoutError as e:
            raise BusTimeout(f"no reply on {subject} within {timeout}s") from e

    async def _go(self, subject: str, body: bytes, timeout: float,
                  sent: dict[str, str] | None) -> bytes:
        try:
            msg = await self._nc.request(subject, body, timeout=timeout, headers=sent)
        except NoRespondersError as e:
            raise BusUnavailable(f"no service answers on {subject}") from e
        except NatsTimeout as e:
            raise BusTimeout(f"no reply on {subject} within {timeout}s") from e
        except MaxPayloadError as e:
            raise PayloadTooLarge(f"a {len(body)}-byte request is over the server's "
                                  "max_payload") from e
        except NatsError as e:  # nothing nats-shaped leaves bus/
            raise translate(e) from e
        return bytes(msg.data)

    def files(self) -> FileStore:
        """The tenants' file buckets over this client's connection (bus.objects)."""
        return FileStore(self._nc, self._loop.run)

    def close(self) -> None:
        try:
            self._loop.run(self._nc.close(), timeout=5)
        finally:
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
