"""Following the telemetry stream live (`pool telemetry follow`, `pool lease logs -f`): an
ordered replay first when asked, then new samples, a tenant's bound to its leases' nodes."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
)
from nats.nuid import NUID

from bus.connection import connect
from bus.errors import BusUnavailable, PermissionDenied
from bus.headers import HDR_LAST_CONSUMER, HDR_STATUS
from bus.runtime import translate
from bus.subjects import command_subject
from bus.telemetry import (
    REPLAY_POLL_S,
    OnSample,
    ReplayRefused,
    TelemetrySample,
    telemetry_filter,
)
from bus.telemetry_streams import streams_holding

log = logging.getLogger(__name__)


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
        stream: str,
    ) -> None:
        self._nc = nc
        self._stream = stream
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
        await self._nc.jsm().add_consumer(self._stream, config=config)

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

    Without `since`: a core subscription (live only). With `since`: the stored samples from that
    time on, then live, without a gap: one ordered consumer a telemetry stream (each in its own
    order), or, `as_tenant`, pages from the control plane (`fields`: the pool/node/lease/kind
    filter). `refused`: a future the connection's error callback completes on a permission
    violation, raised here as PermissionDenied."""
    queue: asyncio.Queue[TelemetrySample] = asyncio.Queue()
    replays: list[_OrderedReplay] = []
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
            # one ordered consumer a stream that may hold such samples (each tenant's own)
            replays = [_OrderedReplay(nc, filter_subject, since, queue, stream)
                       for stream in await streams_holding(nc, filter_subject)]
            create = asyncio.ensure_future(asyncio.gather(*(r.start() for r in replays)))
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
        for replay in replays:
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


__all__ = ["follow", "follow_telemetry"]
