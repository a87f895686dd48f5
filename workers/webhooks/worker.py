"""The webhook deliverer, a plane worker: a durable consumer on the lease feed fans each record
out to the tenant's matching endpoints (their states stored in KV before the record is acked),
and each endpoint's deliveries go out in feed order, retried with exponential backoff."""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from domain.webhook import Endpoint, WebhookEndpoints
from schemas.feed import FeedRecord
from workers import metrics
from workers.errors import ServiceError
from workers.webhooks import signing
from workers.webhooks.addresses import resolve
from workers.webhooks.desk import message, secret_context
from workers.webhooks.post import post
from workers.webhooks.settings import WebhookSettings

if TYPE_CHECKING:
    from bus.leader import LeaderElection
    from bus.webhooks import FeedMessage, WebhookBus
    from workers.application import PoolApp

log = logging.getLogger(__name__)

ENDPOINTS_FRESH_S = 1.0  # how long a tenant's endpoints are used before they are read again
OVER_CAP_DELAY_S = 5.0  # a record held back by the in-flight cap is handed out again after
POSTERS = 8  # POSTs in flight at once (one per endpoint at most)


@dataclass(order=True)
class Delivery:
    """One record for one endpoint: pending until a 2xx answer (delivered) or until it has
    been tried for `give_up_seconds` (failed)."""

    seq: int
    tenant: str = field(compare=False)
    endpoint_id: str = field(compare=False)
    lease_id: str = field(compare=False)
    record_state: str = field(compare=False)
    record: dict[str, Any] = field(compare=False)
    state: str = field(default="pending", compare=False)
    attempts: int = field(default=0, compare=False)
    first_tried_at: float | None = field(default=None, compare=False)
    next_at: float = field(default=0.0, compare=False)
    last_status: int | None = field(default=None, compare=False)
    last_error: str | None = field(default=None, compare=False)
    updated_at: float = field(default=0.0, compare=False)

    @property
    def queue(self) -> tuple[str, str]:
        return self.tenant, self.endpoint_id

    def to_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "endpoint_id": self.endpoint_id, "seq": self.seq,
                "webhook_id": str(self.seq), "lease_id": self.lease_id,
                "record_state": self.record_state, "state": self.state,
                "attempts": self.attempts, "first_tried_at": self.first_tried_at,
                "next_at": self.next_at if self.state == "pending" else None,
                "last_status": self.last_status, "last_error": self.last_error,
                "updated_at": self.updated_at, "record": self.record}

    @classmethod
    def of(cls, d: dict[str, Any]) -> Delivery:
        return cls(seq=int(d["seq"]), tenant=str(d["tenant"]), endpoint_id=str(d["endpoint_id"]),
                   lease_id=str(d.get("lease_id") or ""),
                   record_state=str(d.get("record_state") or ""),
                   record=dict(d.get("record") or {}), state=str(d.get("state") or "pending"),
                   attempts=int(d.get("attempts") or 0), first_tried_at=d.get("first_tried_at"),
                   next_at=float(d.get("next_at") or 0.0), last_status=d.get("last_status"),
                   last_error=d.get("last_error"), updated_at=float(d.get("updated_at") or 0))


class Deliverer:
    """Runs on a thread of its own while `election` (if any) says this process delivers; one
    deliverer delivers at a time, so each endpoint's records go out in feed order."""

    def __init__(self, app: PoolApp, bus: WebhookBus, settings: WebhookSettings, *,
                 election: LeaderElection | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.bus = bus
        self.settings = settings
        self.election = election
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str], list[Delivery]] = {}
        self._busy: set[tuple[str, str]] = set()
        self._known: set[tuple[str, str, int]] = set()  # every delivery stored (any state)
        self._pending: dict[str, int] = {}  # per tenant
        self._books: dict[str, tuple[float, dict[str, Endpoint]]] = {}
        self._loaded = False
        self._posters = concurrent.futures.ThreadPoolExecutor(
            max_workers=POSTERS, thread_name_prefix="pool-webhook-post")

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> Deliverer:
        if self.election is not None:
            self.election.start()
        self._thread = threading.Thread(target=self._run, name="pool-webhooks", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._posters.shutdown(wait=True, cancel_futures=True)
        if self.election is not None:
            self.election.stop(release=True)
        self.bus.close()

    def _leading(self) -> bool:
        return self.election is None or self.election.is_leader

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._leading():
                    self._forget()
                    self._stop.wait(0.2)
                    continue
                if not self._loaded:
                    self._load()
                for msg in self.bus.fetch(100, timeout=self._wait()):
                    self._fan_out(msg)
                self._dispatch()
            except Exception:  # the bus may be away: keep trying
                log.exception("webhook deliverer: a round failed; trying again")
                self._stop.wait(1.0)

    def _wait(self) -> float:
        """How long a fetch may wait: until the next retry is due, at most half a second."""
        with self._lock:
            heads = [q[0].next_at for k, q in self._queues.items() if q and k not in self._busy]
        if not heads:
            return 0.5
        return max(0.05, min(0.5, min(heads) - self.clock()))

    def _forget(self) -> None:
        with self._lock:
            self._queues.clear()
            self._known.clear()
            self._pending.clear()
            self._loaded = False

    def _load(self) -> None:
        """Every stored delivery: the pending ones queued again (a restart re-sends what was
        in flight, with the same webhook-id), the rest known so no record is fanned out twice."""
        stored = [Delivery.of(d) for d in self.bus.states(">")]
        with self._lock:
            for d in stored:
                self._known.add((d.tenant, d.endpoint_id, d.seq))
                if d.state == "pending":
                    heapq.heappush(self._queues.setdefault(d.queue, []), d)
                    self._pending[d.tenant] = self._pending.get(d.tenant, 0) + 1
            self._loaded = True
        metrics.WEBHOOK_PENDING.set(sum(self._pending.values()))

    # -- fanning out ------------------------------------------------------------------------

    def _endpoints(self, tenant: str) -> dict[str, Endpoint]:
        now = time.monotonic()
        got = self._books.get(tenant)
        if got is not None and now - got[0] < ENDPOINTS_FRESH_S:
            return got[1]
        book = self.app.find(WebhookEndpoints, WebhookEndpoints.create_id(tenant))
        endpoints = dict(book.endpoints) if book is not None else {}
        self._books[tenant] = (now, endpoints)
        return endpoints

    def _fan_out(self, msg: FeedMessage) -> None:
        try:
            record = msgspec.json.decode(msg.body, type=FeedRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            msg.ack()  # not a record: nothing to deliver
            return
        tenant = record.tenant
        wanted = [e for e in self._endpoints(tenant).values()
                  if msg.seq > e.after_seq and e.wants(record.state)
                  and (tenant, e.endpoint_id, msg.seq) not in self._known]
        if not wanted:
            msg.ack()
            return
        with self._lock:
            over = self._pending.get(tenant, 0) + len(wanted) > self.settings.max_in_flight
        if over:
            metrics.LIMITS_HIT.inc()
            msg.nak(OVER_CAP_DELAY_S)  # handed out again once some went out
            return
        from bus.webhooks import delivery_key

        now = self.clock()
        body = msgspec.to_builtins(record)
        for e in wanted:
            d = Delivery(seq=msg.seq, tenant=tenant, endpoint_id=e.endpoint_id,
                         lease_id=record.lease_id, record_state=record.state, record=body,
                         next_at=now, updated_at=now)
            self.bus.put(delivery_key(tenant, e.endpoint_id, msg.seq), d.to_dict())
            with self._lock:
                self._known.add((tenant, e.endpoint_id, msg.seq))
                heapq.heappush(self._queues.setdefault(d.queue, []), d)
                self._pending[tenant] = self._pending.get(tenant, 0) + 1
        msg.ack()  # stored: a restart finds them in KV
        metrics.WEBHOOK_PENDING.set(sum(self._pending.values()))

    # -- delivering -------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hand each endpoint's first pending delivery whose time has come to a poster."""
        now = self.clock()
        with self._lock:
            due = [q[0] for k, q in self._queues.items()
                   if q and k not in self._busy and q[0].next_at <= now]
            for d in due:
                self._busy.add(d.queue)
        for d in due:
            self._posters.submit(self._deliver, d)

    def _deliver(self, d: Delivery) -> None:
        try:
            endpoint = self._endpoints(d.tenant).get(d.endpoint_id)
            if endpoint is None:
                self._settle(d, "dropped", None, "the endpoint was deleted")
                return
            status, error = self._post(d, endpoint)
            if status is not None and 200 <= status < 300:
                self._settle(d, "delivered", status, None)
            else:
                self._failed(d, status, error)
        except Exception as e:  # a bug or the bus away: retried later
            log.exception("webhook delivery %s/%s failed", d.endpoint_id, d.seq)
            self._failed(d, None, repr(e)[:200])

    def _post(self, d: Delivery, endpoint: Endpoint) -> tuple[int | None, str | None]:
        assert self.settings.key is not None
        now = self.clock()
        if d.first_tried_at is None:
            d.first_tried_at = now
        d.attempts += 1
        try:
            secret = signing.unseal(self.settings.key, endpoint.sealed_secret,
                                    context=secret_context(d.tenant, d.endpoint_id))
            _host, _port, addresses = resolve(endpoint.url, self.settings.allow)
        except (ServiceError, signing.SealedSecretUnreadable) as e:
            return None, str(e)[:200]
        body = message(f"lease.{d.record_state}", d.record, now, feed_seq=d.seq)
        headers = signing.headers(secret, str(d.seq), int(now), body)
        try:
            return post(endpoint.url, addresses[0], body, headers,
                        timeout=self.settings.timeout_seconds), None
        except (OSError, ValueError) as e:  # http.client's errors are OSError or ValueError
            return None, str(e)[:200] or type(e).__name__

    def _failed(self, d: Delivery, status: int | None, error: str | None) -> None:
        now = self.clock()
        if now - (d.first_tried_at or now) >= self.settings.give_up_seconds:
            self._settle(d, "failed", status, error)
            return
        metrics.WEBHOOK_DELIVERIES.labels("retried").inc()
        d.last_status, d.last_error = status, error or (f"answered {status}" if status else None)
        d.next_at = now + self.settings.backoff(d.attempts)
        d.updated_at = now
        self._store(d)
        with self._lock:
            self._busy.discard(d.queue)

    def _settle(self, d: Delivery, state: str, status: int | None, error: str | None) -> None:
        d.state, d.last_status, d.last_error = state, status, error
        d.updated_at = self.clock()
        metrics.WEBHOOK_DELIVERIES.labels(state).inc()
        self._store(d)
        with self._lock:
            q = self._queues.get(d.queue)
            if q and q[0] is d:
                heapq.heappop(q)
            elif q and d in q:
                q.remove(d)
                heapq.heapify(q)
            if not q:
                self._queues.pop(d.queue, None)
            self._pending[d.tenant] = max(0, self._pending.get(d.tenant, 0) - 1)
            self._busy.discard(d.queue)
        metrics.WEBHOOK_PENDING.set(sum(self._pending.values()))

    def _store(self, d: Delivery) -> None:
        from bus.webhooks import delivery_key

        try:
            self.bus.put(delivery_key(d.tenant, d.endpoint_id, d.seq), d.to_dict())
        except Exception as e:  # noqa: BLE001 - kept in memory; the next change stores it
            log.warning("webhook delivery state not stored: %r", e)
