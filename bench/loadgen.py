"""The NATS side of the end-to-end benchmark: tenants' clients and a watcher of reservations.
What `pool bench e2e` measures: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.errors import Error as NatsError
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus.connection import connect
from bus.feed import feed_filter
from bus.headers import HDR_ORIGINATOR_ID, HDR_TOPIC
from bus.replies import tenant_inbox
from bus.subjects import EVENTS_PREFIX, EVENTS_STREAM, command_subject


@dataclass(frozen=True)
class Sent:
    """One request: when it left and came back (wall clock), and what the reply said."""

    sent_at: float
    replied_at: float
    ok: bool
    lease_ids: tuple[str, ...]
    code: str


def _lease_ids(reply: dict[str, Any]) -> tuple[str, ...]:
    result = reply.get("result") or {}
    ids = result.get("lease_ids") if isinstance(result, dict) else None
    if isinstance(ids, list):
        return tuple(str(i) for i in ids)
    lease = reply.get("lease")
    if isinstance(lease, dict) and "lease_id" in lease:
        return (str(lease["lease_id"]),)
    return ()


async def _one(nc: Any, subject: str, body: bytes, timeout: float) -> Sent:
    t0 = time.time()
    try:
        msg = await nc.request(subject, body, timeout=timeout)
    except (TimeoutError, NatsError) as e:
        return Sent(t0, time.time(), False, (), type(e).__name__)
    t1 = time.time()
    try:
        reply = json.loads(msg.data)
    except ValueError:
        return Sent(t0, t1, False, (), "malformed_reply")
    ok = bool(reply.get("ok"))
    code = "" if ok else str((reply.get("error") or {}).get("code", "unknown"))
    return Sent(t0, t1, ok, _lease_ids(reply) if ok else (), code)


async def _drive(url: str, tenants: list[str], clients: int, seconds: float,
                 rate: float | None, make_body: Any, timeout: float) -> list[Sent]:
    conns = []
    for i in range(clients):
        tenant = tenants[i % len(tenants)]
        conns.append((tenant, await connect(
            url, inbox_prefix=tenant_inbox(tenant).encode(),
            pending_size=8 * 1024 * 1024)))
    out: list[Sent] = []
    deadline = time.monotonic() + seconds
    counter = iter(range(1 << 62))
    try:
        if rate is None:  # closed loop: each client sends its next request on its reply

            async def client(tenant: str, nc: Any) -> None:
                subject = command_subject(tenant, "lease", "request")
                while time.monotonic() < deadline:
                    out.append(await _one(nc, subject, make_body(next(counter)), timeout))

            await asyncio.gather(*(client(t, nc) for t, nc in conns))
        else:  # open loop: requests leave on a fixed schedule, whatever the replies do
            tasks = []
            start = time.monotonic()
            n = 0
            while True:
                at = start + n / rate
                if at >= deadline:
                    break
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tenant, nc = conns[n % len(conns)]
                tasks.append(asyncio.ensure_future(_one(
                    nc, command_subject(tenant, "lease", "request"), make_body(next(counter)), timeout)))
                n += 1
            out.extend(await asyncio.gather(*tasks))
    finally:
        for _, nc in conns:
            await nc.close()
    return out


def run_clients(url: str, *, tenants: list[str], clients: int, seconds: float,
                rate: float | None, make_body: Any, timeout: float = 30.0) -> list[Sent]:
    """`clients` connections requesting leases for `seconds`: closed loop when `rate` is
    None, else `rate` requests/s offered in all. `make_body(i)` gives request i's bytes."""
    return asyncio.run(_drive(url, tenants, clients, seconds, rate, make_body, timeout))


class _State(msgspec.Struct):
    """The part of a feed record the watcher reads."""

    lease_id: str
    state: str


_decode_state = msgspec.json.Decoder(_State).decode


class FeedWatcher:
    """What the tenants see: each tenant's live lease feed (`pool.feedlive.<tenant>.…`, as
    `pool lease watch` follows it), subscribed to on one connection; the wall-clock time each
    lease's first `reserved` record arrived."""

    def __init__(self, url: str, tenants: list[str]) -> None:
        self.url = url
        self.tenants = list(tenants)
        self.reserved: dict[str, float] = {}
        self.records = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-watcher",
                                        daemon=True)
        self._nc: Any = None
        self._subs: list[Any] = []

    def start(self) -> FeedWatcher:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(15)
        return self

    async def _start(self) -> None:
        self._nc = await connect(self.url, pending_size=64 * 1024 * 1024)
        reserved = self.reserved

        async def on_msg(msg: Any) -> None:
            t = time.time()
            self.records += 1
            try:
                record = _decode_state(msg.data)
            except msgspec.DecodeError:
                return
            if record.state == "reserved" and record.lease_id not in reserved:
                reserved[record.lease_id] = t

        for tenant in self.tenants:
            self._subs.append(await self._nc.subscribe(
                feed_filter(tenant, live=True), cb=on_msg, pending_msgs_limit=1_000_000,
                pending_bytes_limit=512 * 1024 * 1024))
        await self._nc.flush()

    def stop(self) -> None:
        async def close() -> None:
            for sub in self._subs:
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
            if self._nc is not None:
                await self._nc.close()
            # the client's flusher ends with the loop
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


def stored_times(url: str, after: int, *, timeout: float = 60.0
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """When the server stored each lease's `LeaseRequested` and its first `LeaseReserved`
    after log sequence `after` (the stream's own timestamps, unix seconds), read once the
    load is over so the reading adds nothing to what was measured."""

    async def go() -> tuple[dict[str, float], dict[str, float]]:
        nc = await connect(url, pending_size=64 * 1024 * 1024)
        requested: dict[str, float] = {}
        reserved: dict[str, float] = {}
        try:
            js = nc.jetstream()
            end = int((await js.stream_info(EVENTS_STREAM)).state.last_seq)
            if end <= after:
                return requested, reserved
            done = asyncio.get_running_loop().create_future()

            async def on_msg(msg: Any) -> None:
                meta = msg.metadata
                headers = msg.headers or {}
                topic = headers.get(HDR_TOPIC, "")
                lid = headers.get(HDR_ORIGINATOR_ID, "")
                at = meta.timestamp.timestamp()
                if topic.endswith("LeaseReserved"):
                    reserved.setdefault(lid, at)
                elif topic.endswith("LeaseRequested"):
                    requested.setdefault(lid, at)
                if (meta.num_pending == 0 or meta.sequence.stream >= end) and not done.done():
                    done.set_result(None)

            sub = await js.subscribe(f"{EVENTS_PREFIX}.>", stream=EVENTS_STREAM, cb=on_msg,
                                     ordered_consumer=True, headers_only=True,
                                     config=ConsumerConfig(
                                         deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                         opt_start_seq=after + 1),
                                     pending_msgs_limit=1_000_000,
                                     pending_bytes_limit=512 * 1024 * 1024)
            try:
                await asyncio.wait_for(done, timeout)
            finally:
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
        finally:
            await nc.close()
        return requested, reserved

    return asyncio.run(go())
