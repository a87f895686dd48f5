"""The command responders: every request the route table serves, answered as one Envelope.

Refusals leave as typed error codes (schema, domain, service, bus); nothing is appended on one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry.trace import SpanKind, use_span

from bus import observability
from bus.errors import BusError
from bus.service import FastHandler
from domain.errors import DomainError, RateLimited
from schemas import v1
from schemas.codec import SchemaError, encode
from schemas.feed import FeedReplay
from workers import fastpaths, metrics
from workers.application import PoolApp
from workers.errors import ServiceError, UnknownSubject
from workers.routes import NODE_VERBS, QUERY_VIEWS, ROUTES, Router, subscriptions
from workers.telemetry_binding import LeaseNodes

if TYPE_CHECKING:
    from workers.secrets.desk import SecretDesk
    from workers.webhooks.desk import WebhookDesk

log = logging.getLogger(__name__)

# what the command responders subscribe to, from the route table; queries only with a database
_SERVED = subscriptions(["commands"])
ADMIN_SUBJECTS = [s for s in _SERVED if s.startswith("pool.admin.")]
COMMAND_SUBJECTS = [s for s in _SERVED if s not in ADMIN_SUBJECTS]
QUERY_SUBJECTS = subscriptions(["queries"])
# the lanes (workers/plane.py): node agents' reports, and tenants' reads of the streams (with
# the queries above), each answered apart from the tenants' and operators' commands
NODE_SUBJECTS = [s for s in COMMAND_SUBJECTS if s.startswith("pool.node.")]
READ_SUBJECTS = [s for s in COMMAND_SUBJECTS if s.endswith((".telemetry.replay", ".feed.replay"))]
_ROUTER = Router(ROUTES, served_by=("commands", "queries"))


def ok(*, lease: dict[str, Any] | None = None, result: dict[str, Any] | None = None) -> bytes:
    return encode(v1.Envelope.success(lease=lease, result=result))


def failure(code: str, message: str, reasons: dict[str, int | str] | None = None) -> bytes:
    return encode(v1.Envelope.failure(code, message, reasons))


def _span_name(subject: str) -> str:
    """`lease.request`, `lease.commit`, `node.heartbeat`, `admin.pool.set`: ids left out."""
    parts = subject.split(".")
    if parts[:2] == ["pool", "cmd"] and len(parts) >= 5:
        return f"{parts[3]}.{parts[-1]}"
    if parts[:2] == ["pool", "node"]:
        return f"node.{parts[-1]}"
    if parts[:2] == ["pool", "admin"]:
        return "admin." + ".".join(p for p in parts[2:] if p in _ADMIN_WORDS)
    return "command"


_ADMIN_WORDS = frozenset({"pool", "tenant", "node", "credits", "set", "show", "prices", "images",
                          "register", "grant", "enroll", *NODE_VERBS})


def _domain_reasons(e: DomainError) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    for r in getattr(e, "reasons", ()) or ():
        out[str(r)] = 1
    out.update(getattr(e, "details", {}))  # a limit's numbers (rate_limited: its Retry-After)
    return out


class CommandHandler:
    """Turns (subject, body) into a reply; `why` is answered by the scheduler processes, which
    know (each asks a pool's leader where it does not lead that pool)."""

    def __init__(self, app: PoolApp, database_url: str | None = None, *,
                 views_schema: str | None = None,
                 telemetry_pages: Callable[..., Any] | None = None,
                 feed_pages: Callable[..., Any] | None = None,
                 webhooks: WebhookDesk | None = None,
                 secrets: SecretDesk | None = None) -> None:
        self.app = app
        # what webhook commands are answered with
        self.webhooks = webhooks
        # secret commands, a commit's secret versions, and the nodes' fetches
        self.secrets = secrets
        self.database_url = database_url
        self.views_schema = views_schema
        self._reader: Any = None
        # (tenant, filter subject, after_seq=, since=, limit=) → bus.telemetry.TelemetryPage
        self.telemetry_pages = telemetry_pages
        # (tenant, lease=, after_seq=, limit=) → bus.telemetry.TelemetryPage of the feed;
        # (tenant, end=True) → the feed's last sequence
        self.feed_pages = feed_pages
        self._lease_nodes = LeaseNodes(feed_pages) if feed_pages is not None else None
        # what the service answers on its loop (bus.service.Service's `fast`): None with
        # POOL_FAST_PATHS=off, so every command takes the thread path
        self.fast: FastHandler | None = self.on_loop if fastpaths.ON else None

    def __call__(self, subject: str, body: bytes, headers: dict[str, str]) -> bytes:
        # a span per command, child of the requester's `traceparent` header when it sent one
        with observability.tracer().start_as_current_span(
            _span_name(subject), context=observability.extract(headers),
            kind=SpanKind.SERVER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ) as span:
            code, reply = self._answer(subject, body)
            if code:
                span.set_attribute("pool.error.code", code)
                metrics.REFUSALS.labels(code).inc()  # a stable code: the labels stay few
            return reply

    async def on_loop(self, subject: str, body: bytes,
                      headers: dict[str, str]) -> bytes | None:
        """The reply on the bus's loop for a route with a fast handler, when its common case
        applies; None: answer it with `__call__` on a worker thread."""
        found = _ROUTER.fast_route(subject)
        if found is None:
            return None
        route, params = found
        assert route.fast is not None
        if not observability.tracing() and not observability.carries_trace(headers):
            # no span would be recorded and none is named to pass on: the no-op span and its
            # context are skipped, and the command sees the same empty trace it would have
            try:
                cmd = route.decode(body)
            except SchemaError as e:
                return encode(e.to_envelope())
            try:
                envelope = await route.fast(self, params, cmd)
            except RateLimited as e:  # a flood is answered here, never handed to a thread
                return failure(e.code, str(e), _domain_reasons(e))
            except Exception:  # noqa: BLE001 - the thread path answers it, errors and all
                return None
            return None if envelope is None else encode(envelope)
        span = observability.tracer().start_span(
            _span_name(subject), context=observability.extract(headers), kind=SpanKind.SERVER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject})
        with use_span(span, end_on_exit=False):
            try:
                cmd = route.decode(body)
            except SchemaError as e:
                span.set_attribute("pool.error.code", e.code)
                span.end()
                return encode(e.to_envelope())
            try:
                envelope = await route.fast(self, params, cmd)
            except RateLimited as e:
                span.set_attribute("pool.error.code", e.code)
                span.end()
                return failure(e.code, str(e), _domain_reasons(e))
            except Exception:  # noqa: BLE001 - the thread path answers it, errors and all
                envelope = None
        if envelope is None:
            # left unended, so never exported: the thread path traces the command once
            return None
        span.end()
        return encode(envelope)

    def _answer(self, subject: str, body: bytes) -> tuple[str | None, bytes]:
        """The reply, and the error code when it is a refusal."""
        try:
            return None, self.route(subject, body)
        except SchemaError as e:
            return e.code, encode(e.to_envelope())
        except DomainError as e:
            return e.code, failure(e.code, str(e), _domain_reasons(e))
        except ServiceError as e:
            return e.code, failure(e.code, e.message, e.reasons)
        except BusError as e:
            return e.code, failure(e.code, str(e))
        except Exception:  # a bug: logged, answered, and the service keeps serving
            log.exception("command on %s failed", subject)
            return "internal_error", failure("internal_error",
                                             "the command failed inside the service")

    def route(self, subject: str, body: bytes) -> bytes:
        return encode(_ROUTER.dispatch(self, subject, body))

    # -- the route table's Context -------------------------------------------------------

    def why(self, tenant: str, lease_id: str, at: float | None = None) -> v1.Envelope:
        raise UnknownSubject("`why` is answered by the scheduler processes")

    def queue_positions(self, tenant: str) -> v1.Envelope:
        raise UnknownSubject("queue positions are answered by the scheduler processes")

    def pool_shares(self, pool_id: str) -> v1.Envelope:
        raise UnknownSubject("fair shares are answered by the scheduler processes")

    def query_view(self, tenant: str, view: str, q: v1.Query) -> v1.Envelope:
        """A page of one of the tenant's views, read from PostgreSQL: only its own rows."""
        if view not in QUERY_VIEWS:
            raise UnknownSubject(f"no view {view!r}; tenants may query {', '.join(QUERY_VIEWS)}")
        if not self.database_url:
            return v1.Envelope.failure("views_unavailable",
                                       "this service has no database for the views")
        if self._reader is None:
            from projections.queries import ViewReader
            from projections.views import DEFAULT_SCHEMA

            self._reader = ViewReader(self.database_url, self.views_schema or DEFAULT_SCHEMA)
        from projections.errors import BadQuery, ViewsUnavailable

        try:
            page = self._reader.query(view, tenant=tenant, filters=dict(q.filters),
                                      limit=q.limit, cursor=q.cursor, at=q.at)
        except (BadQuery, ViewsUnavailable) as e:
            return v1.Envelope.failure(e.code, str(e))
        return v1.Envelope.success(result=page)

    def telemetry_replay(self, tenant: str, q: v1.TelemetryReplay) -> v1.Envelope:
        """A page of the tenant's own telemetry: the tenant token is the subject's, so the
        filter can only narrow within it."""
        if self.telemetry_pages is None:
            return v1.Envelope.failure("telemetry_unavailable",
                                       "this service does not read telemetry")
        from bus.telemetry import telemetry_filter

        filt = telemetry_filter(pool=q.pool, node=q.node, tenant=tenant, lease=q.lease,
                                kind=q.kind)
        page = self.telemetry_pages(tenant, filt, after_seq=q.after_seq, since=q.since,
                                    limit=q.limit)
        stored = page.samples
        if self._lease_nodes is not None:
            # a node speaks only for the leases it held: the rest is another's forgery
            stored, forged = self._lease_nodes.keep(tenant, stored)
            if forged:
                metrics.REFUSALS.labels("telemetry_not_held").inc(forged)
        last = max((seq for seq, _, _ in page.samples), default=page.skipped_to)
        samples = []
        for seq, subject, data in stored:
            try:
                event = msgspec.json.decode(data)
            except msgspec.DecodeError:
                event = None  # an agent's garbled sample: its place in the stream still shows
            samples.append({"seq": seq, "subject": subject, "event": event})
        # `last_seq`: where the next page starts, forged samples skipped included
        return v1.Envelope.success(result={"samples": samples, "at_end": page.at_end,
                                           "last_seq": last})

    def feed_replay(self, tenant: str, q: FeedReplay) -> v1.Envelope:
        """A page of the tenant's own lease feed: the tenant token is the subject's, so a
        tenant reads no other's records."""
        if self.feed_pages is None:
            return v1.Envelope.failure("feed_unavailable", "this service does not read the feed")
        if q.from_end:
            return v1.Envelope.success(result={"records": [], "at_end": True,
                                               "last_seq": self.feed_pages(tenant, end=True)})
        page = self.feed_pages(tenant, lease=q.lease, after_seq=q.after_seq, limit=q.limit)
        records = []
        for seq, subject, data in page.samples:
            try:
                record = msgspec.json.decode(data)
            except msgspec.DecodeError:
                record = None
            records.append({"seq": seq, "subject": subject, "record": record})
        return v1.Envelope.success(result={"records": records, "at_end": page.at_end})

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
