"""Telemetry's publisher, samples and stream pages (`pool.tel.…`; tenants' streams are
bus.telemetry_streams'). Docs: docs/operations.md#telemetry-job-output-and-tracing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime as dt
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.errors import BusError, BusUnavailable
from bus.headers import HDR_NUM_PENDING, HDR_SEQUENCE, HDR_STATUS, HDR_SUBJECT
from bus.runtime import BusRuntime
from bus.streams import ensure_stream, telemetry_stream_config
from bus.subjects import (
    TELEMETRY_PREFIX,
    TELEMETRY_STREAM,
    telemetry_subject,
    token,
)
from schemas import v1

TELEMETRY_KINDS: tuple[str, ...] = ("queue", "startup", "execution", "utilization", "failure",
                                     "output")

# samples waiting for the loop thread; beyond this the publisher drops (telemetry is lossy)
MAX_IN_FLIGHT = 10_000

log = logging.getLogger(__name__)


async def ensure_telemetry_stream(js: JetStreamContext, replicas: int = 1) -> None:
    """POOL_TELEMETRY, made or updated; an existing one keeps a larger max_bytes (a store from
    before each tenant had a stream: the tenants' samples in it stay until they age out)."""
    config = telemetry_stream_config(replicas)
    try:
        have = int((await js.stream_info(TELEMETRY_STREAM)).config.max_bytes or -1)
    except NotFoundError:
        have = 0
    if have < 0 or have > (config.max_bytes or 0):
        config = dataclasses.replace(config, max_bytes=have)
    await ensure_stream(js, config)


class TelemetryPublisher:
    """A synchronous facade for agents: `publish` never blocks on the server and never raises
    on a bus hiccup (it logs); it owns its own event-loop thread and connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._rt = BusRuntime(url)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._dropped = 0

    def publish(
        self,
        *,
        pool: str,
        node: str,
        tenant: str,
        lease: str,
        kind: str,
        event: v1.TelemetryEvent,
        headers: dict[str, str] | None = None,
    ) -> None:
        if kind not in TELEMETRY_KINDS:
            raise ValueError(f"unknown telemetry kind {kind!r}; one of {TELEMETRY_KINDS}")
        subject = telemetry_subject(pool, node, tenant, lease, kind)
        data = msgspec.json.encode(event)
        with self._lock:
            if self._in_flight >= MAX_IN_FLIGHT:
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 1000 == 0:
                    log.warning("telemetry backlog full: %d samples dropped", self._dropped)
                return
            self._in_flight += 1
        try:
            fut = self._rt.submit(self._publish(subject, data, dict(headers) if headers else None))
        except (RuntimeError, BusError) as e:  # the runtime or its loop is closed
            with self._lock:
                self._in_flight -= 1
            log.warning("telemetry not published on %s: %s", subject, e)
            return
        fut.add_done_callback(lambda f: self._done(subject, f))

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        nc = await self._rt.connection()
        await nc.publish(subject, data, headers=headers)

    def _done(self, subject: str, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._in_flight -= 1
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.warning("telemetry not published on %s: %r", subject, exc)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until queued samples reached the server's socket (best effort; for tests, exit)."""

        async def go() -> None:
            nc = await self._rt.connection()
            await nc.flush(timeout=max(1, int(timeout)))

        try:
            self._rt.run(go(), timeout=timeout + 1)
        except Exception as e:  # noqa: BLE001 - lossy by design
            log.warning("telemetry flush failed: %r", e)

    def close(self) -> None:
        self._rt.close()



# -- following -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TelemetrySample:
    """One received sample: where it came from (the subject's tokens) and what it says."""

    subject: str
    pool: str
    node: str
    tenant: str
    lease: str
    kind: str
    event: v1.TelemetryEvent | None  # None when the payload did not decode (see `error`)
    headers: dict[str, str] = field(default_factory=dict)
    stream_seq: int | None = None  # set when the sample came from the stream (a replay)
    error: str | None = None

    @classmethod
    def from_message(
        cls, subject: str, data: bytes, headers: dict[str, str] | None, stream_seq: int | None
    ) -> TelemetrySample:
        parts = subject.split(".")
        pool, node, tenant, lease, kind = (parts[2:7] + [""] * 5)[:5]
        event: v1.TelemetryEvent | None = None
        error = None
        try:
            event = msgspec.json.decode(data, type=v1.TelemetryEvent)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            error = str(e)
        return cls(subject, pool, node, tenant, lease, kind, event, dict(headers or {}),
                   stream_seq, error)


def telemetry_filter(
    *,
    pool: str | None = None,
    node: str | None = None,
    tenant: str | None = None,
    lease: str | None = None,
    kind: str | None = None,
) -> str:
    """The subject filter selecting those samples: `*` where a token is not given."""
    if kind is not None and kind not in TELEMETRY_KINDS:
        raise ValueError(f"unknown telemetry kind {kind!r}; one of {', '.join(TELEMETRY_KINDS)}")
    tokens = [token(t) if t else "*" for t in (pool, node, tenant, lease, kind)]
    return ".".join([TELEMETRY_PREFIX, *tokens])


OnSample = Callable[[TelemetrySample], Awaitable[None] | None]

class ReplayRefused(BusError):
    """The control plane refused a tenant's telemetry replay (its code is in the message)."""

    code = "replay_refused"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"telemetry replay refused [{code}]: {message}")
        self.refusal_code = code


REPLAY_PAGE_MAX_BYTES = 512 * 1024  # a page stays well under NATS's 1 MiB max_payload
REPLAY_POLL_S = 0.5  # a tenant's follower asks for the next page this often once caught up


@dataclass(frozen=True)
class TelemetryPage:
    """Stored samples in stream order: (stream sequence, subject, payload); `at_end` when no
    more matched when the page was read; `skipped_to`, where nonzero, a sequence the next page
    may start after though no sample of this one reached it (a tenant's samples from before
    its own stream, all read)."""

    samples: list[tuple[int, str, bytes]]
    at_end: bool
    skipped_to: int = 0


async def read_page_async(
    nc: Client,
    filter_subject: str,
    *,
    after_seq: int = 0,
    since: float | None = None,
    limit: int = 500,
    timeout: float = 5.0,
    stream: str = TELEMETRY_STREAM,
) -> TelemetryPage:
    """One batched direct get on `stream` (POOL_TELEMETRY unless named): the messages under
    `filter_subject` after stream sequence `after_seq` (or, when that is 0, from the time
    `since`), at most `limit`."""
    req: dict[str, Any] = {"batch": int(limit), "next_by_subj": filter_subject,
                           "max_bytes": REPLAY_PAGE_MAX_BYTES}
    if after_seq > 0 or since is None:
        req["seq"] = int(after_seq) + 1
    else:
        req["start_time"] = dt.datetime.fromtimestamp(since, dt.UTC).isoformat()
    out: list[tuple[int, str, bytes]] = []
    done: asyncio.Future[tuple[bool, str | None]] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Msg) -> None:
        if done.done():
            return
        headers = msg.headers or {}
        status = headers.get(HDR_STATUS)
        if status:
            if status == "404":
                done.set_result((True, None))
            elif status == "204":  # end of this batch
                done.set_result((int(headers.get(HDR_NUM_PENDING, "0") or 0) == 0, None))
            else:
                done.set_result((True, f"{status} {headers.get('Description', '')}".strip()))
            return
        out.append((int(headers[HDR_SEQUENCE]), headers.get(HDR_SUBJECT, msg.subject),
                    msg.data))

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg)
    try:
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}",
                         msgspec.json.encode(req), reply=inbox)
        at_end, error = await asyncio.wait_for(done, timeout)
    finally:
        await sub.unsubscribe()
    if error == "503":
        raise BusUnavailable(f"the stream {stream} is not available for reads")
    if error is not None:
        raise BusUnavailable(f"reading {stream} failed: {error}")
    return TelemetryPage(out, at_end)


def read_page(runtime: BusRuntime, filter_subject: str, **kw: Any) -> TelemetryPage:
    """`read_page_async` from a synchronous caller (the command service)."""
    async def go() -> TelemetryPage:
        return await read_page_async(await runtime.connection(), filter_subject, **kw)

    return runtime.run(go())


__all__ = [
    "TELEMETRY_KINDS",
    "TelemetryPage",
    "TelemetryPublisher",
    "TelemetrySample",
    "ensure_telemetry_stream",
    "read_page",
    "read_page_async",
    "telemetry_filter",
]
