"""The command worker: routes `pool.cmd.<tenant>.…`, `pool.node.<node>.…` (agent reports) and
`pool.admin.…` requests to PoolApp.

Every reply is one Envelope. Bad input, unknown pools and leases, illegal transitions and
infrastructure failures each leave as a typed error code; nothing is appended on a refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
from opentelemetry.trace import SpanKind

from bus import observability
from bus.errors import BusError
from bus.subjects import is_token
from control.application import PoolApp, lease_view
from control.errors import ServiceError, UnknownSubject
from domain.errors import DomainError
from schemas import v1
from schemas.codec import SchemaError, decode_command, encode

log = logging.getLogger(__name__)

LEASE_VERBS = ("commit", "heartbeat", "renew", "release", "cancel", "get")
NODE_VERBS = ("cordon", "drain", "maintenance", "uncordon", "end-maintenance", "lost")
# one subscription per verb: `why` is answered by the scheduler, which holds the reasons
NODE_LEASE_VERBS = ("stopped", "started", "exited", "failed")
NODE_REPORTS = ("register", "heartbeat")
# node agents report on `pool.node.<node>.lease.<lease>.<verb>` and `pool.node.<node>.<report>`
# (their credentials allow publishing only under their own node); the command worker answers
NODE_SUBJECTS = ([f"pool.node.*.lease.*.{v}" for v in NODE_LEASE_VERBS]
                 + [f"pool.node.*.{r}" for r in NODE_REPORTS])
# `pool.cmd.<tenant>.telemetry.replay`: a page of the tenant's own samples from the telemetry
# stream, so tenants replay without the right to create consumers
TELEMETRY_SUBJECTS = ["pool.cmd.*.telemetry.replay"]
COMMAND_SUBJECTS = (
    ["pool.cmd.*.lease.request"]
    + [f"pool.cmd.*.lease.*.{v}" for v in LEASE_VERBS]
    + NODE_SUBJECTS
    + TELEMETRY_SUBJECTS
)
ADMIN_SUBJECTS = ["pool.admin.>"]
# `pool.cmd.<tenant>.query.<view>`: answered from the PostgreSQL views by a CommandHandler given
# a database URL; kept apart from COMMAND_SUBJECTS so a plane without a database never answers
QUERY_SUBJECTS = ["pool.cmd.*.query.*"]
QUERY_VIEWS = ("queue", "balance", "leases")


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
                          "register", "grant", *NODE_VERBS})


def _domain_reasons(e: DomainError) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    for r in getattr(e, "reasons", ()) or ():
        out[str(r)] = 1
    return out


class CommandHandler:
    """Turns (subject, body) into a reply; `why` is answered by the scheduler, which knows."""

    def __init__(self, app: PoolApp, database_url: str | None = None, *,
                 views_schema: str | None = None,
                 telemetry_pages: Callable[..., Any] | None = None) -> None:
        self.app = app
        self.database_url = database_url
        self.views_schema = views_schema
        self._reader: Any = None
        # (filter subject, after_seq=, since=, limit=) → bus.telemetry.TelemetryPage
        self.telemetry_pages = telemetry_pages

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
            return reply

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
        parts = subject.split(".")
        if parts[:2] == ["pool", "cmd"] and len(parts) >= 5 and parts[3] == "lease":
            tenant = parts[2]
            if len(parts) == 5 and parts[4] == "request":
                req = decode_command("lease.request", body)
                assert isinstance(req, v1.LeaseRequest)
                # the lease keeps this command's trace, so placing and starting it join it
                lease = self.app.request_lease(tenant, req,
                                               trace_parent=observability.traceparent())
                return ok(lease=lease_view(lease))
            if len(parts) == 6 and parts[5] in LEASE_VERBS:
                return self.lease_verb(tenant, parts[4], parts[5], body)
        if (parts[:2] == ["pool", "node"] and len(parts) == 6 and parts[3] == "lease"
                and parts[5] in NODE_LEASE_VERBS):
            return self.node_lease_verb(parts[2], parts[4], parts[5], body)
        if parts[:2] == ["pool", "node"] and len(parts) == 4 and parts[3] in NODE_REPORTS:
            return self.node_report(parts[2], parts[3], body)
        if parts[:2] == ["pool", "admin"]:
            return self.admin(parts[2:], body)
        if parts[:2] == ["pool", "cmd"] and len(parts) == 5 and parts[3] == "query":
            return self.query(parts[2], parts[4], body)
        if parts[:2] == ["pool", "cmd"] and parts[3:] == ["telemetry", "replay"]:
            return self.telemetry_replay(parts[2], body)
        raise UnknownSubject(f"no command is answered on {subject}")

    def lease_verb(self, tenant: str, lease_id: str, verb: str, body: bytes) -> bytes:
        cmd = decode_command(f"lease.{verb}", body)
        app = self.app
        calls: dict[str, Callable[[], Any]] = {
            "commit": lambda: app.commit(tenant, lease_id, cmd),  # type: ignore[arg-type]
            "heartbeat": lambda: app.heartbeat(tenant, lease_id, cmd),  # type: ignore[arg-type]
            "renew": lambda: app.renew(tenant, lease_id, cmd),  # type: ignore[arg-type]
            "release": lambda: app.release(tenant, lease_id, cmd),  # type: ignore[arg-type]
            "cancel": lambda: app.cancel(tenant, lease_id, cmd),  # type: ignore[arg-type]
            "get": lambda: app.get(tenant, lease_id),
        }
        return ok(lease=lease_view(calls[verb]()))

    def query(self, tenant: str, view: str, body: bytes) -> bytes:
        """A page of one of the tenant's views, read from PostgreSQL: only its own rows."""
        q = decode_command("query", body)
        assert isinstance(q, v1.Query)
        if view not in QUERY_VIEWS:
            raise UnknownSubject(f"no view {view!r}; tenants may query {', '.join(QUERY_VIEWS)}")
        if not self.database_url:
            return failure("views_unavailable", "this service has no database for the views")
        if self._reader is None:
            from projections.queries import ViewReader
            from projections.views import DEFAULT_SCHEMA

            self._reader = ViewReader(self.database_url, self.views_schema or DEFAULT_SCHEMA)
        from projections.queries import BadQuery, ViewsUnavailable

        try:
            page = self._reader.query(view, tenant=tenant, filters=dict(q.filters),
                                      limit=q.limit, cursor=q.cursor)
        except (BadQuery, ViewsUnavailable) as e:
            return failure(e.code, str(e))
        return ok(result=page)

    def telemetry_replay(self, tenant: str, body: bytes) -> bytes:
        """A page of the tenant's own telemetry: the tenant token is the subject's, so the
        filter can only narrow within it."""
        q = decode_command("telemetry.replay", body)
        assert isinstance(q, v1.TelemetryReplay)
        if self.telemetry_pages is None:
            return failure("telemetry_unavailable", "this service does not read telemetry")
        from bus.telemetry import telemetry_filter

        filt = telemetry_filter(pool=q.pool, node=q.node, tenant=tenant, lease=q.lease,
                                kind=q.kind)
        page = self.telemetry_pages(filt, after_seq=q.after_seq, since=q.since, limit=q.limit)
        samples = []
        for seq, subject, data in page.samples:
            try:
                event = msgspec.json.decode(data)
            except msgspec.DecodeError:
                event = None  # an agent's garbled sample: its place in the stream still shows
            samples.append({"seq": seq, "subject": subject, "event": event})
        return ok(result={"samples": samples, "at_end": page.at_end})

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def node_lease_verb(self, node_id: str, lease_id: str, verb: str, body: bytes) -> bytes:
        cmd = decode_command(f"node.{verb}", body)
        app = self.app
        if isinstance(cmd, v1.LeaseStopped):
            lease = app.confirm_stopped(node_id, lease_id, cmd)
        elif isinstance(cmd, v1.JobStarted):
            lease = app.job_started(node_id, lease_id, cmd)
        elif isinstance(cmd, v1.JobExited):
            lease = app.job_ended(node_id, lease_id, epoch=cmd.epoch, exit_code=cmd.exit_code)
        else:
            assert isinstance(cmd, v1.JobFailed)
            lease = app.job_ended(node_id, lease_id, epoch=cmd.epoch, failure=cmd.reason)
        return ok(lease=lease_view(lease))

    def node_report(self, node_id: str, report: str, body: bytes) -> bytes:
        """An agent's registration or heartbeat, for the node its subject names only."""
        if report == "register":
            reg = decode_command("agent.register", body)
            assert isinstance(reg, v1.NodeRegistration)
            node = self.app.register_own_node(node_id, reg)
            return ok(result={"node_id": node.node_id, "state": str(node.state)})
        hb = decode_command("agent.heartbeat", body)
        assert isinstance(hb, v1.NodeHeartbeat)
        return ok(result=self.app.node_heartbeat(node_id, hb))

    def admin(self, path: list[str], body: bytes) -> bytes:
        app = self.app
        match path:
            case ["pool", "set"]:
                cfg = decode_command("admin.pool", body)
                assert isinstance(cfg, v1.PoolConfig)
                app.configure_pool(cfg)
                return ok(result=app.pool_settings(cfg.pool_id))
            case ["pool", "show"]:
                show = decode_command("admin.pool.show", body)
                assert isinstance(show, v1.PoolShow)
                return ok(result=app.pool_settings(show.pool_id))
            case ["pool", "prices"]:
                pl = decode_command("admin.pool.prices", body)
                assert isinstance(pl, v1.PriceListConfig)
                app.set_prices(pl)
                return ok(result=app.pool_settings(pl.pool_id))
            case ["pool", "images"]:
                ip = decode_command("admin.pool.images", body)
                assert isinstance(ip, v1.ImagePolicyConfig)
                app.set_image_policy(ip)
                return ok(result=app.pool_settings(ip.pool_id))
            case ["tenant", "set"]:
                tc = decode_command("admin.tenant", body)
                assert isinstance(tc, v1.TenantConfig)
                pol = app.set_tenant(tc)
                return ok(result={"tenant": pol.tenant_id, "pool_id": pol.pool_id,
                                  "weight": pol.weight / 1000,
                                  "quota": None if pol.quota is None else pol.quota.to_dict()})
            case ["node", "register"]:
                reg = decode_command("agent.register", body)
                assert isinstance(reg, v1.NodeRegistration)
                node = app.register_node(reg)
                return ok(result={"node_id": node.node_id, "state": str(node.state)})
            case ["node", node_id, verb] if verb in NODE_VERBS and is_token(node_id):
                ch = decode_command("admin.node.state", body)
                assert isinstance(ch, v1.NodeStateChange)
                node = app.node_state(node_id, verb, ch.reason or "")
                return ok(result={"node_id": node.node_id, "state": str(node.state)})
            case ["credits", "grant"]:
                g = decode_command("admin.credits.grant", body)
                assert isinstance(g, v1.CreditGrant)
                acc = app.grant(g.tenant, g.amount_microcredits, g.transfer_id, g.reason or "")
                return ok(result={"tenant": g.tenant, "available_microcredits": acc.available,
                                  "granted_microcredits": acc.granted})
        raise UnknownSubject(f"no admin command {'.'.join(path)!r}")
