"""The telemetry stream, its publisher and its follower (subjects `pool.tel.…`).
Subjects, loss, retention and tenants' replay: docs/operations.md#telemetry-job-output-and-tracing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
)
from nats.nuid import NUID

from bus.connection import connect
from bus.errors import BusError, BusUnavailable, PermissionDenied
from bus.headers import HDR_LAST_CONSUMER, HDR_NUM_PENDING, HDR_SEQUENCE, HDR_STATUS, HDR_SUBJECT
from bus.runtime import BusRuntime, translate
from bus.streams import ensure_stream, telemetry_stream_config
from bus.subjects import (
    TELEMETRY_PREFIX,
    TELEMETRY_STREAM,
    command_subject,
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
    await ensure_stream(js, telemetry_stream_config(replicas))


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

IDLE_HEARTBEAT_S = 2.0
INACTIVE_THRESHOLD_S = 10.0  # an abandoned replay consumer goes away on its own


class _OrderedReplay:
    """An ordered push consumer: ephemeral, no acks, recreated from the next stream sequence
    whenever a delivery is missed (a gap in consumer sequence or lost heartbeats).

    Created with the filter in the API subject (`$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`)
    so a tenant's permission can pin the filter to its own tenant token.
    """

    def __init__(
        self,
        nc: Client,
        filter_subject: str,
        start_time: dt.datetime | None,
        queue: asyncio.Queue[TelemetrySample],
    ) -> None:
        self._nc = nc
        self._filter = filter_subject
        self._start_time = start_time
        self._queue = queue
        self._sub: Subscription | None = None
        self._consumer_seq = 0
        self._stream_seq = 0
        self._last_activity = 0.0
        self._resetting = False
        self._generation = 0
        self._watchdog: asyncio.Task[None] | None = None
        self._reset_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._create()
        self._watchdog = asyncio.create_task(self._watch())

    async def _create(self) -> None:
        name = "tel_" + NUID().next().decode()
        deliver = self._nc.new_inbox()
        if self._stream_seq:
            policy = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE,
                      "opt_start_seq": self._stream_seq + 1}
        elif self._start_time is not None:
            policy = {"deliver_policy": DeliverPolicy.BY_START_TIME,
                      "opt_start_time": self._start_time}
        else:
            policy = {"deliver_policy": DeliverPolicy.NEW}
        config = ConsumerConfig(
            name=name,
            filter_subject=self._filter,
            deliver_subject=deliver,
            ack_policy=AckPolicy.NONE,
            max_deliver=1,
            mem_storage=True,
            num_replicas=1,
            idle_heartbeat=IDLE_HEARTBEAT_S,
            inactive_threshold=INACTIVE_THRESHOLD_S,
            **policy,  # type: ignore[arg-type]
        )
        self._consumer_seq = 0
        self._generation += 1
        generation = self._generation

        async def on_message(msg: Msg) -> None:
            if generation == self._generation:
                await self._on_message(msg)  # else: a late delivery of a replaced consumer

        self._sub = await self._nc.subscribe(deliver, cb=on_message)
        self._last_activity = asyncio.get_running_loop().time()
        # nats-py puts the filter in the create subject when the consumer has a name
        await self._nc.jsm().add_consumer(TELEMETRY_STREAM, config=config)

    async def _on_message(self, msg: Msg) -> None:
        self._last_activity = asyncio.get_running_loop().time()
        headers = msg.headers or {}
        if headers.get(HDR_STATUS):  # idle heartbeat: it says the last consumer sequence sent
            last = headers.get(HDR_LAST_CONSUMER)
            if last is not None and int(last) != self._consumer_seq:
                self._reset_soon()
            return
        meta = msg.metadata
        if meta.sequence.consumer != self._consumer_seq + 1:
            self._reset_soon()
            return
        self._consumer_seq = meta.sequence.consumer
        self._stream_seq = meta.sequence.stream
        await self._queue.put(
            TelemetrySample.from_message(msg.subject, msg.data, headers, meta.sequence.stream)
        )

    def _reset_soon(self) -> None:
        # not inline: unsubscribing from inside the subscription's own callback cancels it
        if not self._resetting:
            self._resetting = True
            self._reset_task = asyncio.ensure_future(self._reset(claimed=True))

    async def _reset(self, *, claimed: bool = False) -> None:
        if self._resetting and not claimed:
            return
        self._resetting = True
        try:
            if self._sub is not None:
                try:
                    await self._sub.unsubscribe()
                except nats.errors.Error:
                    pass
            await self._create()
        except Exception as e:  # noqa: BLE001 - retried by the watchdog
            log.debug("telemetry replay: recreating the consumer failed: %r", e)
        finally:
            self._resetting = False

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(IDLE_HEARTBEAT_S)
            if loop.time() - self._last_activity > 3 * IDLE_HEARTBEAT_S and self._nc.is_connected:
                await self._reset()

    async def stop(self) -> None:
        for task in (self._watchdog, self._reset_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass


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
    more matched when the page was read."""

    samples: list[tuple[int, str, bytes]]
    at_end: bool


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


async def _replay_via_service(
    nc: Client,
    tenant: str,
    fields: dict[str, str],
    since: dt.datetime,
    queue: asyncio.Queue[TelemetrySample],
) -> None:
    """A tenant's replay: pages from the control plane, then the next pages as they come, in
    stream order, none skipped or repeated (each page continues after the last sequence).
    Raises BusUnavailable when no control plane answers, ReplayRefused on a refusal."""
    after = 0
    subject = command_subject(tenant, "telemetry", "replay")
    while True:
        body: dict[str, Any] = {**fields, "limit": 500}
        if after:
            body["after_seq"] = after
        else:
            body["since"] = since.timestamp()
        try:
            reply = await nc.request(subject, msgspec.json.encode(body), timeout=10)
        except nats.errors.NoRespondersError:
            raise BusUnavailable(f"no control plane answers telemetry replay on {subject}") \
                from None
        except (TimeoutError, nats.errors.TimeoutError):
            await asyncio.sleep(REPLAY_POLL_S)
            continue
        env = msgspec.json.decode(reply.data)
        if not env.get("ok"):
            err = env.get("error") or {}
            raise ReplayRefused(str(err.get("code")), str(err.get("message")))
        result = env.get("result") or {}
        # past samples left out as not their lease's node's: never asked for again
        after = max(after, int(result.get("last_seq") or 0))
        for s in result.get("samples", []):
            after = max(after, int(s["seq"]))
            await queue.put(TelemetrySample.from_message(
                s["subject"], msgspec.json.encode(s.get("event")), {}, int(s["seq"])))
        if result.get("at_end", True):
            await asyncio.sleep(REPLAY_POLL_S)


class _HeldBy:
    """Whether a node held a lease, as the tenant's lease feed says (read through the control
    plane's `feed.replay`, the only writer of the feed): a live sample from a node the feed
    does not name is another node's forgery. A node not named is asked about again at most
    once a second (a placement's record may trail its first sample by a moment)."""

    RETRY_S = 1.0
    MAX_LEASES = 10_000

    def __init__(self, nc: Client, tenant: str) -> None:
        self._nc, self._tenant = nc, tenant
        self._nodes: dict[str, set[str]] = {}
        self._asked: dict[tuple[str, str], float] = {}

    async def held(self, lease: str, node: str) -> bool:
        if node in self._nodes.get(lease, ()):
            return True
        now = asyncio.get_running_loop().time()
        if now - self._asked.get((lease, node), -self.RETRY_S) < self.RETRY_S:
            return False
        if len(self._asked) > self.MAX_LEASES:
            self._asked.clear()
        self._asked[(lease, node)] = now
        if len(self._nodes) > self.MAX_LEASES:
            self._nodes.clear()
        self._nodes[lease] = nodes = await self._read(lease)
        return node in nodes

    async def _read(self, lease: str) -> set[str]:
        nodes: set[str] = set()
        after = 0
        subject = command_subject(self._tenant, "feed", "replay")
        while True:
            try:
                reply = await self._nc.request(subject, msgspec.json.encode(
                    {"lease": lease, "after_seq": after, "limit": 500}), timeout=5)
                env = msgspec.json.decode(reply.data)
            except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
                return nodes  # unknown: nothing shown from it until it can be told
            result = (env.get("result") or {}) if env.get("ok") else {}
            records = result.get("records") or []
            for r in records:
                after = max(after, int(r.get("seq") or 0))
                node = (r.get("record") or {}).get("node_id")
                if isinstance(node, str):
                    nodes.add(node)
            if result.get("at_end", True) or not records:
                return nodes


async def follow_telemetry(
    nc: Client,
    on_sample: OnSample,
    *,
    filter_subject: str,
    since: dt.datetime | None = None,
    max_samples: int | None = None,
    duration_s: float | None = None,
    refused: asyncio.Future[str] | None = None,
    on_ready: Callable[[], None] | None = None,
    as_tenant: str | None = None,
    fields: dict[str, str] | None = None,
) -> int:
    """Call `on_sample` for each sample under `filter_subject` until cancelled, `max_samples`
    arrived or `duration_s` passed; return how many arrived.

    Without `since`: a core subscription (live only). With `since`: the stream from that time
    on, then live, without a gap — one ordered consumer does both, or, `as_tenant`, pages from
    the control plane (`fields`: the pool/node/lease/kind filter). `refused` is a future the
    connection's error callback completes on a permission violation; it is raised here as
    PermissionDenied.
    """
    queue: asyncio.Queue[TelemetrySample] = asyncio.Queue()
    replay: _OrderedReplay | None = None
    paging: asyncio.Task[None] | None = None
    sub: Subscription | None = None
    loop = asyncio.get_running_loop()
    refused = refused if refused is not None else loop.create_future()

    # a tenant's live samples pass only from the nodes its leases' feeds name
    held = _HeldBy(nc, as_tenant) if as_tenant is not None and since is None else None

    async def on_core(msg: Msg) -> None:
        sample = TelemetrySample.from_message(msg.subject, msg.data, msg.headers, None)
        if held is not None and not await held.held(sample.lease, sample.node):
            return
        await queue.put(sample)

    def check_refused() -> None:
        if refused.done():
            raise PermissionDenied(refused.result())
        if paging is not None and paging.done() and not paging.cancelled():
            paging.result()  # raises what stopped the tenant's replay

    try:
        if since is None:
            sub = await nc.subscribe(filter_subject, cb=on_core)
            # a refused subscription is answered with -ERR before the PONG of this flush
            await nc.flush(timeout=5)
        elif as_tenant is not None:
            paging = asyncio.ensure_future(
                _replay_via_service(nc, as_tenant, fields or {}, since, queue))
        else:
            replay = _OrderedReplay(nc, filter_subject, since, queue)
            create = asyncio.ensure_future(replay.start())
            first: set[asyncio.Future[Any]] = {create, refused}
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            check_refused()
            await create
        check_refused()
        if on_ready is not None:
            on_ready()
        count = 0
        deadline = None if duration_s is None else loop.time() + duration_s
        while max_samples is None or count < max_samples:
            timeout = 0.5 if deadline is None else min(0.5, deadline - loop.time())
            if timeout <= 0:
                break
            try:
                sample = await asyncio.wait_for(queue.get(), timeout)
            except TimeoutError:
                check_refused()
                continue
            count += 1
            result = on_sample(sample)
            if result is not None:
                await result
        return count
    except PermissionDenied:
        raise
    except Exception as e:
        if refused.done():
            raise PermissionDenied(refused.result()) from e
        translated = translate(e)
        if translated is e:
            raise
        raise translated from e
    finally:
        if paging is not None:
            paging.cancel()
            await asyncio.gather(paging, return_exceptions=True)
        if replay is not None:
            await replay.stop()
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass


def follow(
    url: str,
    on_sample: OnSample,
    *,
    pool: str | None = None,
    node: str | None = None,
    tenant: str | None = None,
    lease: str | None = None,
    kind: str | None = None,
    since: dt.datetime | None = None,
    user: str | None = None,
    password: str | None = None,
    inbox_prefix: str | None = None,
    max_samples: int | None = None,
    duration_s: float | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """The synchronous follower for the CLI: connect (as a tenant when given its user and inbox
    prefix: then `--since` replays through the control plane), follow until Ctrl-C
    (KeyboardInterrupt reaches the caller), `max_samples` or `duration_s`, close. Raises
    BusUnavailable or PermissionDenied."""
    filter_subject = telemetry_filter(pool=pool, node=node, tenant=tenant, lease=lease, kind=kind)
    as_tenant = tenant if (user and tenant and inbox_prefix) else None
    fields = {k: v for k, v in (("pool", pool), ("node", node), ("lease", lease),
                                ("kind", kind)) if v}

    async def go() -> int:
        loop = asyncio.get_running_loop()
        refused: asyncio.Future[str] = loop.create_future()

        async def on_error(e: Exception) -> None:
            if "permissions violation" in str(e).lower() and not refused.done():
                refused.set_result(str(e).removeprefix("nats: "))
            else:
                log.debug("telemetry follow: %r", e)

        options: dict[str, Any] = {"user": user, "password": password} if user else {}
        if inbox_prefix:
            options["inbox_prefix"] = inbox_prefix.encode()
        nc = await connect(url, error_cb=on_error, **options)
        try:
            return await follow_telemetry(
                nc, on_sample, filter_subject=filter_subject, since=since,
                max_samples=max_samples, duration_s=duration_s, refused=refused,
                on_ready=on_ready, as_tenant=as_tenant, fields=fields,
            )
        finally:
            with contextlib.suppress(Exception):  # closing is best effort
                await nc.close()

    return asyncio.run(go())


__all__ = [
    "TELEMETRY_KINDS",
    "TelemetryPage",
    "TelemetryPublisher",
    "TelemetrySample",
    "ensure_telemetry_stream",
    "follow",
    "follow_telemetry",
    "read_page",
    "read_page_async",
    "telemetry_filter",
]
