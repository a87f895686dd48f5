"""Server-Sent Event streams: a lease's state changes (its tenant's lease feed) and a tenant's
telemetry, resumable.
Event ids and resuming: docs/api-http.md#streams-server-sent-events.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import ServerSentEvent, ServerSentEventMessage

from bus.subjects import command_subject, is_token
from domain.lease import TERMINAL_STATES
from gateway import problems
from gateway.routes import HttpRoute
from gateway.shared import Gateway, Refused, plain_uint
from gateway.tokens import Principal

TELEMETRY_IDLE_SECONDS = 0.5  # at the end of the stream, how long before reading on
KEEPALIVE_SECONDS = 15.0
# streams one token may hold open at once: each holds a NATS connection or polls the control
# plane, so one tenant opening them without end would starve every other
MAX_STREAMS_PER_TOKEN = 16
# a lease in one of these states changes no more: its stream ends after saying so
FINAL_STATES = frozenset(str(s) for s in TERMINAL_STATES)
# the largest stream sequence a replay takes (its after_seq)
MAX_SEQUENCE = 2**63 - 1
TELEMETRY_KINDS = ("queue", "startup", "execution", "utilization", "failure", "output")
# a lease the command service reports ended may not have its terminal record in the feed yet
# (the feed is written after the command): how long its stream waits for that record
FEED_LAG_SECONDS = 10.0


def _last_event_id(request: Request[Any, Any, Any]) -> int:
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if raw is None or raw == "":
        return 0
    after = plain_uint(raw, MAX_SEQUENCE)
    if after is None:
        raise Refused("invalid_field", "Last-Event-ID must be a non-negative integer",
                      {"path": "Last-Event-ID"})
    return after


class Held:
    """One open stream of a token, counted in `gw.streams` until released, once: when its
    events end (or the client goes), or when a response never sent is collected."""

    def __init__(self, gw: Gateway, who: Principal) -> None:
        self.gw, self.who, self.released = gw, who, False
        gw.streams[who] = gw.streams.get(who, 0) + 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        left = self.gw.streams.get(self.who, 1) - 1
        if left > 0:
            self.gw.streams[self.who] = left
        else:
            self.gw.streams.pop(self.who, None)


async def _counted(held: Held, events: AsyncIterator[ServerSentEventMessage],
                   ) -> AsyncGenerator[ServerSentEventMessage, None]:
    try:
        async for item in events:
            yield item
    finally:
        held.release()
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def counted_stream(gw: Gateway, who: Principal,
                   events: AsyncIterator[ServerSentEventMessage]) -> ServerSentEvent:
    """`events` as a response, counted against the token's open streams (check_room said
    there was room): the API's streams and the dashboard's alike."""
    held = Held(gw, who)
    body = _counted(held, events)
    weakref.finalize(body, held.release)  # a body never iterated never runs its finally
    return ServerSentEvent(body, headers=_headers())


def check_room(gw: Gateway, who: Principal) -> None:
    """Refuse (`too_many_requests`) a stream past the token's MAX_STREAMS_PER_TOKEN."""
    held = gw.streams.get(who, 0)
    if held >= MAX_STREAMS_PER_TOKEN:
        raise Refused("too_many_requests", f"{held} streams of this token are open; close one "
                      "before opening another", {"max_streams_per_token": MAX_STREAMS_PER_TOKEN})


async def open_stream(gw: Gateway, route: HttpRoute, request: Request[Any, Any, Any],
                      who: Principal, ids: dict[str, str]) -> Response[Any]:
    check_room(gw, who)
    if route.operation_id == "streamTelemetry":
        return await _telemetry(gw, request, who)
    if route.operation_id == "streamComputeLeaseLogs":
        return await _logs(gw, request, who, ids["lease_id"])
    return await _lease_events(gw, request, who, ids["lease_id"])


def _headers() -> dict[str, str]:
    # proxies must not buffer a stream
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _lease_events(gw: Gateway, request: Request[Any, Any, Any], who: Principal,
                        lease_id: str) -> Response[Any]:
    """The lease's state changes from the tenant's lease feed, read as the tenant's own user:
    those stored after Last-Event-ID (a feed sequence), then each as it is stored, until a
    terminal state."""
    from bus.feed import follow

    after = _last_event_id(request)
    first = await gw.upstream.call(who, command_subject(who.tenant, "lease", lease_id, "get"))
    if not first.get("ok"):  # unknown, or another tenant's: missing
        return problems.from_error(first.get("error"), instance=request.url.path)
    ended = (first.get("lease") or {}).get("state") in FINAL_STATES
    url, prefix = gw.upstream.connection_for(who)
    # an ended lease's stream says what is stored and ends, once the feed holds its end
    stored_end = ended and await _feed_holds_end(url, who.tenant, lease_id, prefix)
    lagging = ended and not stored_end

    async def events() -> AsyncIterator[ServerSentEventMessage]:
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            items = follow(url, who.tenant, lease=lease_id, after=after, inbox_prefix=prefix,
                           until_caught_up=stored_end)
            try:
                async for item in items:
                    await queue.put(item)
            except Exception as e:  # noqa: BLE001 - the stream says so and ends
                await queue.put(e)
            finally:
                await items.aclose()
                await queue.put(None)

        task = asyncio.ensure_future(pump())
        # the feed behind an ended lease: its end comes soon, or (gone from the feed) never
        give_up = time.monotonic() + FEED_LAG_SECONDS if lagging else None
        try:
            while True:
                wait = KEEPALIVE_SECONDS if give_up is None else give_up - time.monotonic()
                try:
                    item = await asyncio.wait_for(queue.get(), max(0.0, wait))
                except TimeoutError:
                    if give_up is not None:
                        return
                    yield ServerSentEventMessage(comment="keepalive")
                    continue
                if item is None:
                    return
                if isinstance(item, Exception):
                    yield ServerSentEventMessage(
                        event="error", data=msgspec.json.encode(
                            {"code": getattr(item, "code", "bus_error"),
                             "message": str(item)}).decode())
                    return
                record = item.record
                body = msgspec.json.encode(record).decode() if record is not None else "{}"
                yield ServerSentEventMessage(data=body, event="lease", id=str(item.seq))
                if record is not None and record.state in FINAL_STATES:
                    return
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return counted_stream(gw, who, events())


async def _feed_holds_end(url: str, tenant: str, lease_id: str, prefix: str | None) -> bool:
    """Whether the tenant's feed already holds the lease's terminal record."""
    from bus.feed import follow

    items = follow(url, tenant, lease=lease_id, after=0, inbox_prefix=prefix,
                   until_caught_up=True)
    try:
        async for item in items:
            if item.record is not None and item.record.state in FINAL_STATES:
                return True
    finally:
        await items.aclose()
    return False


async def _telemetry(gw: Gateway, request: Request[Any, Any, Any],
                     who: Principal) -> Response[Any]:
    q = request.query_params
    body: dict[str, Any] = {}
    for name in ("lease", "pool", "node"):
        value = q.get(name)
        if value is not None:
            if not is_token(value):
                raise Refused("invalid_field", f"{name} is not a valid id", {"path": name})
            body[name] = value
    kind = q.get("kind")
    if kind is not None:
        if kind not in TELEMETRY_KINDS:
            raise Refused("invalid_field", f"kind must be one of {', '.join(TELEMETRY_KINDS)}",
                          {"path": "kind"})
        body["kind"] = kind
    after = _last_event_id(request)
    if not after:
        _put_since(q.get("since"), body)
    return await _replay(gw, request, who, body, after, until=None)


async def _replay(gw: Gateway, request: Request[Any, Any, Any], who: Principal,
                  body: dict[str, Any], after: int,
                  until: Callable[[], Awaitable[bool]] | None) -> Response[Any]:
    """Telemetry samples matching `body` from after `after`, as events; streaming on while
    `until` is None, else ending at the end stored once `until()` says so."""
    subject = command_subject(who.tenant, "telemetry", "replay")

    async def page(after_seq: int) -> dict[str, Any]:
        return await gw.upstream.call(
            who, subject, msgspec.json.encode({**body, "after_seq": after_seq, "limit": 500}))

    first = await page(after)
    if not first.get("ok"):
        return problems.from_error(first.get("error"), instance=request.url.path)
    body.pop("since", None)  # a resumed read goes by sequence

    async def events() -> AsyncIterator[ServerSentEventMessage]:
        reply, seq, quiet_since = first, after, time.monotonic()
        while True:
            result = (reply.get("result") or {}) if reply.get("ok") else {}
            samples = result.get("samples") or []
            for s in samples:
                seq = max(seq, int(s.get("seq") or 0))
                event = s.get("event") or {}
                yield ServerSentEventMessage(
                    data=msgspec.json.encode(s).decode(), id=str(seq),
                    event=str(event.get("kind") or "sample") if isinstance(event, dict)
                    else "sample")
            if samples:
                quiet_since = time.monotonic()
            # past samples left out as not the lease's node's (last_seq): never read again
            seq = max(seq, int(result.get("last_seq") or 0))
            if not samples or result.get("at_end"):
                if until is not None and await until():
                    return
                if time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
                    quiet_since = time.monotonic()
                    yield ServerSentEventMessage(comment="keepalive")
                await asyncio.sleep(TELEMETRY_IDLE_SECONDS)
            reply = await page(seq)

    return counted_stream(gw, who, events())


async def _logs(gw: Gateway, request: Request[Any, Any, Any], who: Principal,
                lease_id: str) -> Response[Any]:
    """The job's output samples of one lease (kind `output`): what is stored, then, with
    `follow=1`, what comes until the lease has ended."""
    get = command_subject(who.tenant, "lease", lease_id, "get")
    owned = await gw.upstream.call(who, get)
    if not owned.get("ok"):  # another tenant's lease reads as missing
        return problems.from_error(owned.get("error"), instance=request.url.path)
    q = request.query_params
    follow = q.get("follow", "0")
    if follow not in ("0", "1"):
        raise Refused("invalid_field", "follow must be 0 or 1", {"path": "follow"})
    body: dict[str, Any] = {"lease": lease_id, "kind": "output"}
    after = _last_event_id(request)
    if not after:
        _put_since(q.get("since"), body)

    async def ended() -> bool:
        if follow == "0":
            return True
        reply = await gw.upstream.call(who, get)
        return not reply.get("ok") or (reply.get("lease") or {}).get("state") in FINAL_STATES

    return await _replay(gw, request, who, body, after, until=ended)


def _put_since(since: str | None, body: dict[str, Any]) -> None:
    """The `since` query parameter (seconds since the epoch), checked, into `body`."""
    if since is None:
        return
    try:
        body["since"] = float(since)
    except ValueError:
        raise Refused("invalid_field", "since must be seconds since the epoch",
                      {"path": "since"}) from None
    if not 0 <= body["since"] <= 1e11:
        raise Refused("invalid_field", "since is out of range", {"path": "since"})
