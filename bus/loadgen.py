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

from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy

from bus.connection import connect
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


def _stored_at(msg: Any) -> float:
    """When the server stored a delivered stream message (unix seconds, its own clock)."""
    return float(msg.metadata.timestamp.timestamp())


class ReservedWatcher:
    """Wall-clock time each lease's `LeaseReserved` event reached a headers-only ordered
    consumer of the event stream (an upper bound on when it was stored); beside it, when the
    server stored that event and the lease's `LeaseRequested` (the stream's own timestamps)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.reserved: dict[str, float] = {}
        self.reserved_stored: dict[str, float] = {}
        self.requested_stored: dict[str, float] = {}
        self.appended = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-watcher",
                                        daemon=True)
        self._nc: Any = None
        self._sub: Any = None

    def start(self) -> ReservedWatcher:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(15)
        return self

    async def _start(self) -> None:
        self._nc = await connect(self.url, pending_size=64 * 1024 * 1024)

        async def on_msg(msg: Any) -> None:
            t = time.time()
            self.appended += 1
            headers = msg.headers or {}
            topic = headers.get(HDR_TOPIC, "")
            if topic.endswith("LeaseReserved"):
                lid = headers.get(HDR_ORIGINATOR_ID, "")
                if lid not in self.reserved:
                    self.reserved[lid] = t
                    self.reserved_stored[lid] = _stored_at(msg)
            elif topic.endswith("LeaseRequested"):
                self.requested_stored.setdefault(headers.get(HDR_ORIGINATOR_ID, ""),
                                                 _stored_at(msg))

        js = self._nc.jetstream()
        self._sub = await js.subscribe(f"{EVENTS_PREFIX}.>", stream=EVENTS_STREAM, cb=on_msg,
                           ordered_consumer=True, deliver_policy=DeliverPolicy.NEW,
                           headers_only=True, pending_msgs_limit=1_000_000,
                           pending_bytes_limit=512 * 1024 * 1024)
        await self._nc.flush()

    def stop(self) -> None:
        async def close() -> None:
            if self._sub is not None:
                with contextlib.suppress(NatsError):
                    await self._sub.unsubscribe()
            if self._nc is not None:
                await self._nc.close()
            # the ordered consumer's checks and the client's flusher end with the loop
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
