"""The PostgreSQL views of the "pool" application's log: queue, balance, capacity, leases.

Follows eventsourcing's projection pattern (a materialised view fed by an application's
notifications, with the tracking position recorded with the view), applied in batches: every
fetched batch of notifications and the position it reached are written in ONE PostgreSQL
transaction, so a view is exactly the fold of the log up to its recorded position — a crash
anywhere rolls both back together, and the next run resumes from the recorded position.

Rows are derived from the aggregates' states as the log stands at the end of each batch
(aggregates are folded in memory from the notifications, and loaded at the exact version from
the log on a cache miss), plus per-lease credit totals added up from the Account's events.
Every batch takes a transaction-scoped advisory lock and re-reads the positions under it, so
two projectors (or a projector and a rebuild) never apply an event twice.

Micro-credits are BIGINT throughout; times are epoch seconds (double precision), as in events.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from domain.account import Account
from domain.lease import Lease
from domain.node import Node

APPLICATION_NAME = "pool"
DEFAULT_SCHEMA = "pool_views"
VIEWS: tuple[str, ...] = ("queue", "balance", "capacity", "leases")
DIMENSIONS: tuple[str, ...] = ("cpu_millis", "memory_mib", "gpu_count", "local_disk_gib")
WAITING_STATES = frozenset({"requested", "queued"})
DEFAULT_BATCH = 1000
_CACHE_LIMIT = 100_000


class UnknownView(Exception):
    """A view name that is not one of queue, balance, capacity, leases."""

    code = "unknown_view"


def _ddl(view: str) -> str:
    dims = ", ".join(f"{d}_allocatable BIGINT NOT NULL, {d}_allocated BIGINT NOT NULL"
                     for d in DIMENSIONS)
    return {
        "queue": """CREATE TABLE IF NOT EXISTS {s}.queue (
            lease_id TEXT PRIMARY KEY, pool TEXT NOT NULL, tenant TEXT NOT NULL,
            priority_class TEXT NOT NULL, state TEXT NOT NULL, shape JSONB NOT NULL,
            attempts INTEGER NOT NULL, requested_at DOUBLE PRECISION NOT NULL,
            queued_at DOUBLE PRECISION, last_seq BIGINT NOT NULL);
            CREATE INDEX IF NOT EXISTS queue_tenant ON {s}.queue (tenant, lease_id)""",
        "balance": """CREATE TABLE IF NOT EXISTS {s}.balance (
            tenant TEXT PRIMARY KEY, granted BIGINT NOT NULL, held BIGINT NOT NULL,
            spent BIGINT NOT NULL, available BIGINT NOT NULL, shortfall BIGINT NOT NULL,
            holds INTEGER NOT NULL, version INTEGER NOT NULL, last_seq BIGINT NOT NULL)""",
        "capacity": f"""CREATE TABLE IF NOT EXISTS {{s}}.capacity (
            node_id TEXT PRIMARY KEY, pool TEXT NOT NULL, state TEXT NOT NULL,
            state_reason TEXT, zone TEXT NOT NULL, failure_domain TEXT NOT NULL,
            gpu_model TEXT, {dims}, extended_allocatable JSONB NOT NULL,
            extended_allocated JSONB NOT NULL, allocations INTEGER NOT NULL,
            last_heartbeat_at DOUBLE PRECISION, version INTEGER NOT NULL,
            last_seq BIGINT NOT NULL)""",
        "leases": """CREATE TABLE IF NOT EXISTS {s}.leases (
            lease_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, pool TEXT, state TEXT,
            node_id TEXT, priority_class TEXT, shape JSONB, epoch INTEGER, attempts INTEGER,
            maximum_runtime_seconds INTEGER,
            requested_at DOUBLE PRECISION, queued_at DOUBLE PRECISION,
            reserved_at DOUBLE PRECISION, started_at DOUBLE PRECISION,
            run_ended_at DOUBLE PRECISION, ended_at DOUBLE PRECISION,
            deadline DOUBLE PRECISION, last_heartbeat_at DOUBLE PRECISION,
            hold_microcredits BIGINT, end_reason TEXT, exit_code INTEGER,
            credits_held BIGINT NOT NULL DEFAULT 0, credits_charged BIGINT NOT NULL DEFAULT 0,
            credits_released BIGINT NOT NULL DEFAULT 0,
            credits_shortfall BIGINT NOT NULL DEFAULT 0,
            version INTEGER, last_seq BIGINT NOT NULL);
            CREATE INDEX IF NOT EXISTS leases_tenant ON {s}.leases (tenant, lease_id)""",
    }[view]


TRACKING_DDL = """CREATE TABLE IF NOT EXISTS {s}.tracking (
    view_name TEXT PRIMARY KEY, application_name TEXT NOT NULL,
    notification_id BIGINT NOT NULL, events_applied BIGINT NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now())"""


def check_view(name: str) -> str:
    if name not in VIEWS:
        raise UnknownView(f"no view {name!r}; views are {', '.join(VIEWS)}")
    return name


def _fmt(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(schema))  # type: ignore[arg-type]


def lock_key(schema: str) -> int:
    return zlib.crc32(f"computepool-views:{schema}".encode()) - 2**31


def create_schema(conn: psycopg.Connection[Any], schema: str, views: Iterable[str] = VIEWS) -> None:
    conn.execute(_fmt("CREATE SCHEMA IF NOT EXISTS {s}", schema))
    conn.execute(_fmt(TRACKING_DDL, schema))
    for v in views:
        for stmt in _ddl(check_view(v)).split(";"):
            conn.execute(_fmt(stmt, schema))
        conn.execute(
            _fmt("INSERT INTO {s}.tracking (view_name, application_name, notification_id, "
                 "events_applied) VALUES (%s, %s, 0, 0) ON CONFLICT (view_name) DO NOTHING",
                 schema),
            (v, APPLICATION_NAME),
        )


def drop_view(conn: psycopg.Connection[Any], schema: str, view: str) -> None:
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}.{}").format(
        sql.Identifier(schema), sql.Identifier(check_view(view))))
    conn.execute(_fmt("DELETE FROM {s}.tracking WHERE view_name = %s", schema), (view,))


def positions(conn: psycopg.Connection[Any], schema: str, *, lock: bool = False) -> dict[str, tuple[int, int]]:
    """view → (notification_id, events_applied)."""
    q = "SELECT view_name, notification_id, events_applied FROM {s}.tracking"
    if lock:
        q += " FOR UPDATE"
    try:
        rows = conn.execute(_fmt(q, schema)).fetchall()
    except psycopg.errors.UndefinedTable:
        return {}
    return {r[0]: (int(r[1]), int(r[2])) for r in rows}


# -- folding the log ---------------------------------------------------------------------------


@dataclass
class Batch:
    """What one fetched batch changed: final aggregates touched and per-lease credit deltas."""

    last_id: int = 0
    touched: dict[UUID, int] = field(default_factory=dict)  # aggregate id → last notification id
    credits: dict[str, list[tuple[int, str, str, int, int, int]]] = field(default_factory=dict)
    count_after: dict[str, int] = field(default_factory=dict)


class Folder:
    """Folds notifications into aggregates, in memory, loading from the log on a cache miss."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.aggregates: dict[UUID, Any] = {}

    def clear(self) -> None:
        self.aggregates.clear()

    def apply(self, event: Any) -> Any:
        oid = event.originator_id
        agg = self.aggregates.get(oid)
        if agg is not None and agg.version + 1 == event.originator_version:
            try:
                agg = event.mutate(agg)
            except Exception:  # noqa: BLE001 - fall back to the log's own fold
                agg = None
        else:
            agg = None
        if agg is None:
            agg = self.app.repository.get(oid, version=event.originator_version)
        if len(self.aggregates) >= _CACHE_LIMIT:
            self.aggregates.clear()
        self.aggregates[oid] = agg
        return agg


def _credit_event(event: Any) -> tuple[str, str, int, int, int] | None:
    """(kind, lease_id, held_delta, charged, released, shortfall) from an Account event."""
    name = type(event).__name__
    if name == "CreditsHeld":
        return ("held", event.lease_id, int(event.amount), 0, 0)
    if name == "CreditsSettled":
        return ("settled", event.lease_id, int(event.charged), int(event.released),
                int(event.shortfall))
    if name == "HoldReleased":
        return ("released", event.lease_id, int(event.amount), 0, 0)
    return None


# -- writing rows ------------------------------------------------------------------------------


def _j(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _write_lease(conn: psycopg.Connection[Any], schema: str, views: set[str], lease: Lease,
                 seq: int) -> None:
    lid = str(lease.id)
    state = str(lease.state)
    if "leases" in views:
        cols = {
            "tenant": lease.tenant_id, "pool": lease.pool_id, "state": state,
            "node_id": lease.node_id, "priority_class": lease.priority_class,
            "shape": _j(lease.shape.to_dict()), "epoch": lease.epoch, "attempts": lease.attempts,
            "maximum_runtime_seconds": lease.maximum_runtime_seconds,
            "requested_at": lease.requested_at, "queued_at": lease.queued_at,
            "reserved_at": lease.reserved_at, "started_at": lease.started_at,
            "run_ended_at": lease.run_ended_at, "ended_at": lease.ended_at,
            "deadline": lease.deadline, "last_heartbeat_at": lease.last_heartbeat_at,
            "hold_microcredits": lease.hold_microcredits, "end_reason": lease.end_reason,
            "exit_code": lease.exit_code, "version": lease.version, "last_seq": seq,
        }
        names = list(cols)
        stmt = sql.SQL(
            "INSERT INTO {t} (lease_id, {cols}) VALUES (%s, {vals}) "
            "ON CONFLICT (lease_id) DO UPDATE SET {sets}"
        ).format(
            t=sql.Identifier(schema, "leases"),
            cols=sql.SQL(", ").join(map(sql.Identifier, names)),
            vals=sql.SQL(", ").join(sql.Placeholder() * len(names)),
            sets=sql.SQL(", ").join(
                sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names[:-1])
            + sql.SQL(", last_seq = GREATEST({t}.last_seq, EXCLUDED.last_seq)").format(
                t=sql.Identifier(schema, "leases")),
        )
        conn.execute(stmt, [lid, *cols.values()])
    if "queue" in views:
        if state in WAITING_STATES:
            conn.execute(
                _fmt("INSERT INTO {s}.queue (lease_id, pool, tenant, priority_class, state, "
                     "shape, attempts, requested_at, queued_at, last_seq) "
                     "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (lease_id) DO UPDATE SET "
                     "pool=EXCLUDED.pool, tenant=EXCLUDED.tenant, "
                     "priority_class=EXCLUDED.priority_class, state=EXCLUDED.state, "
                     "shape=EXCLUDED.shape, attempts=EXCLUDED.attempts, "
                     "requested_at=EXCLUDED.requested_at, queued_at=EXCLUDED.queued_at, "
                     "last_seq=EXCLUDED.last_seq", schema),
                (lid, lease.pool_id, lease.tenant_id, lease.priority_class, state,
                 _j(lease.requested_shape.to_dict()), lease.attempts, lease.requested_at,
                 lease.queued_at, seq),
            )
        else:
            conn.execute(_fmt("DELETE FROM {s}.queue WHERE lease_id = %s", schema), (lid,))


def _write_account(conn: psycopg.Connection[Any], schema: str, acc: Account, seq: int) -> None:
    conn.execute(
        _fmt("INSERT INTO {s}.balance (tenant, granted, held, spent, available, shortfall, holds, "
             "version, last_seq) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (tenant) DO "
             "UPDATE SET granted=EXCLUDED.granted, held=EXCLUDED.held, spent=EXCLUDED.spent, "
             "available=EXCLUDED.available, shortfall=EXCLUDED.shortfall, holds=EXCLUDED.holds, "
             "version=EXCLUDED.version, last_seq=EXCLUDED.last_seq", schema),
        (acc.tenant_id, acc.granted, acc.held, acc.spent, acc.available, acc.shortfall,
         len(acc.holds), acc.version, seq),
    )


def _write_node(conn: psycopg.Connection[Any], schema: str, node: Node, seq: int) -> None:
    caps = node.capabilities
    alloc = node.allocated
    dims: list[Any] = []
    for d in DIMENSIONS:
        dims += [getattr(node.allocatable, d), getattr(alloc, d)]
    names = [f"{d}_{k}" for d in DIMENSIONS for k in ("allocatable", "allocated")]
    cols = ["pool", "state", "state_reason", "zone", "failure_domain", "gpu_model", *names,
            "extended_allocatable", "extended_allocated", "allocations", "last_heartbeat_at",
            "version", "last_seq"]
    vals = [node.pool_id, str(node.state), node.state_reason, caps.zone, caps.failure_domain,
            caps.gpu_model, *dims, _j(dict(node.allocatable.extended)), _j(dict(alloc.extended)),
            len(node.allocations), node.last_heartbeat_at, node.version, seq]
    stmt = sql.SQL(
        "INSERT INTO {t} (node_id, {cols}) VALUES (%s, {vals}) "
        "ON CONFLICT (node_id) DO UPDATE SET {sets}"
    ).format(
        t=sql.Identifier(schema, "capacity"),
        cols=sql.SQL(", ").join(map(sql.Identifier, cols)),
        vals=sql.SQL(", ").join(sql.Placeholder() * len(cols)),
        sets=sql.SQL(", ").join(sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n))
                                for n in cols),
    )
    conn.execute(stmt, [node.node_id, *vals])


def _write_credits(conn: psycopg.Connection[Any], schema: str, tenant: str, lease_id: str,
                   kind: str, a: int, b: int, c: int, seq: int) -> None:
    held, charged, released, shortfall = {
        "held": (a, 0, 0, 0),
        "settled": (-(a + b), a, b, c),
        "released": (-a, 0, a, 0),
    }[kind]
    conn.execute(
        _fmt("INSERT INTO {s}.leases (lease_id, tenant, credits_held, credits_charged, "
             "credits_released, credits_shortfall, last_seq) VALUES (%s,%s,%s,%s,%s,%s,%s) "
             "ON CONFLICT (lease_id) DO UPDATE SET "
             "credits_held = {s}.leases.credits_held + EXCLUDED.credits_held, "
             "credits_charged = {s}.leases.credits_charged + EXCLUDED.credits_charged, "
             "credits_released = {s}.leases.credits_released + EXCLUDED.credits_released, "
             "credits_shortfall = {s}.leases.credits_shortfall + EXCLUDED.credits_shortfall, "
             "last_seq = GREATEST({s}.leases.last_seq, EXCLUDED.last_seq)", schema),
        (lease_id, tenant, held, charged, released, shortfall, seq),
    )


# -- the projection ----------------------------------------------------------------------------


class PoolViews:
    """The four views of one schema, fed by the "pool" application `app` (its recorder reads
    JetStream). `process(notifications)` applies one batch in one transaction."""

    def __init__(self, app: Any, database_url: str, *, schema: str = DEFAULT_SCHEMA,
                 views: Sequence[str] = VIEWS) -> None:
        self.app = app
        self.database_url = database_url
        self.schema = schema
        self.views = tuple(check_view(v) for v in views)
        self.folder = Folder(app)
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.database_url)
        return self._conn

    def setup(self) -> None:
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(self.schema),))
            create_schema(self.conn, self.schema, self.views)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def position(self) -> int:
        """The lowest position among this projection's views: where the next batch starts."""
        pos = positions(self.conn, self.schema)
        self.conn.commit()
        return min((pos.get(v, (0, 0))[0] for v in self.views), default=0)

    def process(self, notifications: Sequence[Any]) -> int:
        """Apply one batch; returns how many events some view took (0: all already applied)."""
        if not notifications:
            return 0
        mapper = self.app.mapper
        try:
            events = [(n.id, mapper.to_domain_event(n)) for n in notifications]
            folded = [(seq, ev, self.folder.apply(ev)) for seq, ev in events]
        except Exception:
            self.folder.clear()
            raise
        conn = self.conn
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(self.schema),))
                pos = positions(conn, self.schema, lock=True)
                taken = 0
                for view in self.views:
                    at, applied = pos.get(view, (0, 0))
                    fresh = [(s, e, a) for s, e, a in folded if s > at]
                    if not fresh:
                        continue
                    taken = max(taken, len(fresh))
                    self._apply_view(view, fresh)
                    conn.execute(
                        _fmt("UPDATE {s}.tracking SET notification_id = %s, events_applied = %s, "
                             "updated_at = now() WHERE view_name = %s", self.schema),
                        (fresh[-1][0], applied + len(fresh), view),
                    )
            return taken
        except Exception:
            # the view rolled back; the in-memory fold is ahead of nothing useful now
            self.folder.clear()
            raise

    def _apply_view(self, view: str, fresh: list[tuple[int, Any, Any]]) -> None:
        conn, schema = self.conn, self.schema
        last: dict[UUID, tuple[int, Any]] = {}
        for seq, _ev, agg in fresh:
            last[agg.id] = (seq, agg)
        if view in ("queue", "leases"):
            for seq, agg in last.values():
                if isinstance(agg, Lease):
                    _write_lease(conn, schema, {view}, agg, seq)
            if view == "leases":
                for seq, ev, agg in fresh:
                    if isinstance(agg, Account):
                        c = _credit_event(ev)
                        if c is not None:
                            _write_credits(conn, schema, agg.tenant_id, c[1], c[0], c[2], c[3],
                                           c[4], seq)
        elif view == "balance":
            for seq, agg in last.values():
                if isinstance(agg, Account):
                    _write_account(conn, schema, agg, seq)
        elif view == "capacity":
            for seq, agg in last.values():
                if isinstance(agg, Node):
                    _write_node(conn, schema, agg, seq)

    def catch_up(self, *, batch_size: int = DEFAULT_BATCH, stop: int | None = None) -> int:
        """Apply every batch up to the log's end (or `stop`); returns the events applied."""
        total = 0
        while True:
            start = self.position() + 1
            if stop is not None and start > stop:
                return total
            batch = self.app.recorder.select_notifications(start, batch_size, stop=stop)
            if not batch:
                return total
            total += self.process(batch)


# -- status and rebuild --------------------------------------------------------------------------


def status(database_url: str, max_id: int, *, schema: str = DEFAULT_SCHEMA) -> list[dict[str, Any]]:
    with psycopg.connect(database_url) as conn:
        pos = positions(conn, schema)
    out = []
    for v in VIEWS:
        at, applied = pos.get(v, (0, 0))
        out.append({"view": v, "position": at, "events_applied": applied,
                    "max_notification_id": max_id, "lag": max(0, max_id - at),
                    "exists": v in pos})
    return out


def rebuild(app: Any, database_url: str, *, schema: str = DEFAULT_SCHEMA,
            views: Sequence[str] = VIEWS, batch_size: int = DEFAULT_BATCH) -> int:
    """Drop the views and fold them again from the first event, up to the log's end now.

    Dropping and re-creating happen in one transaction under the projector's lock, so a live
    projector never sees a half-dropped view; it then waits on the lock between batches."""
    names = tuple(check_view(v) for v in views)
    with psycopg.connect(database_url) as conn:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(schema),))
            conn.execute(_fmt("CREATE SCHEMA IF NOT EXISTS {s}", schema))
            conn.execute(_fmt(TRACKING_DDL, schema))
            for v in names:
                drop_view(conn, schema, v)
            create_schema(conn, schema, names)
    proj = PoolViews(app, database_url, schema=schema, views=names)
    try:
        return proj.catch_up(batch_size=batch_size, stop=app.recorder.max_notification_id() or 0)
    finally:
        proj.close()


def dump(database_url: str, schema: str, view: str) -> list[tuple[Any, ...]]:
    """Every row of a view, ordered by key, for comparing a live view with a rebuilt one."""
    key = {"queue": "lease_id", "balance": "tenant", "capacity": "node_id",
           "leases": "lease_id"}[check_view(view)]
    with psycopg.connect(database_url) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {} ORDER BY {}").format(
            sql.Identifier(schema, view), sql.Identifier(key))).fetchall()
