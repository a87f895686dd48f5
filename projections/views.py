"""The PostgreSQL views of the log (queue, balance, capacity, leases), each batch and its position
written in one transaction: docs/architecture.md#the-views.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import msgspec
import psycopg
from psycopg import sql

from bus.transcoder import EventDecoder
from domain.account import Account
from domain.fold import Fold
from domain.lease import TERMINAL_STATES, Lease
from domain.node import Node
from projections.errors import PositionMoved, UnknownView

APPLICATION_NAME = "pool"
DEFAULT_SCHEMA = "pool_views"
VIEWS: tuple[str, ...] = ("queue", "balance", "capacity", "leases")
DIMENSIONS: tuple[str, ...] = ("cpu_millis", "memory_mib", "gpu_count", "local_disk_gib")
WAITING_STATES = frozenset({"requested", "queued"})
DEFAULT_BATCH = 1000
_CACHE_LIMIT = 100_000


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
            holds INTEGER NOT NULL, version INTEGER NOT NULL, last_seq BIGINT NOT NULL)
            WITH (fillfactor = 50)""",
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
            version INTEGER, last_seq BIGINT NOT NULL) WITH (fillfactor = 80);
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
    return sql.SQL(text).format(s=sql.Identifier(schema))


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


class Folder:
    """Folds notifications into aggregates, in memory, loading from the log on a cache miss."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.aggregates: dict[UUID, Any] = {}
        self._fold = Fold(self.aggregates)
        self._is_lease: dict[type, bool] = {}

    def clear(self) -> None:
        self.aggregates.clear()

    def forget_finished(self, folded: Iterable[tuple[int, Any, Any]]) -> None:
        """Drop the leases of a batch that ended (released, cancelled, …): a view's next rows
        for them come from an event they rarely get (a preempted lease's requeue), and if one
        does, `apply` reads the lease at that version from the log. Kept, they are most of a
        long log's heap, which every full pass of the cycle collector walks (seconds-long
        pauses at a million events)."""
        aggregates = self.aggregates
        is_lease = self._is_lease
        for _seq, _ev, agg in folded:
            cls = type(agg)
            lease = is_lease.get(cls)
            if lease is None:
                lease = is_lease[cls] = issubclass(cls, Lease)
            if lease and agg.state in TERMINAL_STATES:
                aggregates.pop(agg.id, None)

    def apply(self, event: Any) -> Any:
        """The aggregate after `event`: the one fold's step over the cache, or, where that
        cannot say (an aggregate not cached, or a step that raised), the log's own fold of it
        at that version."""
        aggregates = self.aggregates
        if len(aggregates) >= _CACHE_LIMIT:
            aggregates.clear()
        try:
            agg = self._fold.step(event)
        except Exception:  # noqa: BLE001 - fall back to the log's own fold
            agg = None
        if agg is None:
            agg = aggregates[event.originator_id] = self.app.repository.get(
                event.originator_id, version=event.originator_version)
        return agg


_CREDIT_KINDS = {"CreditsHeld": "held", "CreditsSettled": "settled", "HoldReleased": "released",
                 "CreditsHeldBatch": "held_batch"}


_UNSEEN: Any = object()


def _credit_extractor(cls: type) -> Any:
    """For an Account's credit events of class `cls` (CreditsHeld, CreditsHeldBatch,
    CreditsSettled, HoldReleased, by name), a function of the event giving a list of (lease id,
    and the deltas on its lease's row: held, charged, released, shortfall) — one per lease the
    event moves credits of; None for any other class."""
    kind = _CREDIT_KINDS.get(cls.__name__)
    if kind is None:
        return None
    if kind == "held":
        return lambda ev: ((ev.lease_id, int(ev.amount), 0, 0, 0),)
    if kind == "held_batch":
        return lambda ev: [(str(lid), int(amount), 0, 0, 0) for _tid, lid, amount in ev.holds]
    if kind == "released":
        return lambda ev: ((ev.lease_id, -int(ev.amount), 0, int(ev.amount), 0),)

    def settled(ev: Any) -> tuple[tuple[str, int, int, int, int]]:
        charged, released = int(ev.charged), int(ev.released)
        return ((ev.lease_id, -(charged + released), charged, released, int(ev.shortfall)),)
    return settled


# -- writing rows ------------------------------------------------------------------------------
#
# One batch's changes are coalesced per row first (a dict keyed by the view's primary key holding
# the row's final state, plus the summed credit deltas of each lease), then each view is written
# with ONE statement: INSERT … SELECT FROM jsonb_array_elements(<the rows as one JSON array of
# arrays>) ON CONFLICT … DO UPDATE, and the queue's deletes with one DELETE … WHERE lease_id =
# ANY(%s). Keys are unique within each statement, so every row is affected at most once, exactly
# as the per-row upserts it replaces. The rows travel as one JSON text encoded by msgspec (C):
# psycopg dumps an array parameter value by value in Python, which costs more per row than the
# JSON (figures: docs/performance.md), and PostgreSQL's cost per row is the same either way.
# Numbers go through JSON's text exactly (integers as they are, floats by shortest round-trip
# repr), jsonb columns are nested JSON values, and SQL NULL is JSON null.


_encode_json = msgspec.json.encode


def _f(value: Any) -> float | None:
    return None if value is None else float(value)


_LEASE_STATE_COLS: tuple[tuple[str, str], ...] = (
    ("lease_id", "text"), ("tenant", "text"), ("pool", "text"), ("state", "text"),
    ("node_id", "text"), ("priority_class", "text"), ("shape", "jsonb"), ("epoch", "integer"),
    ("attempts", "integer"), ("maximum_runtime_seconds", "integer"),
    ("requested_at", "float8"), ("queued_at", "float8"), ("reserved_at", "float8"),
    ("started_at", "float8"), ("run_ended_at", "float8"), ("ended_at", "float8"),
    ("deadline", "float8"), ("last_heartbeat_at", "float8"), ("hold_microcredits", "bigint"),
    ("end_reason", "text"), ("exit_code", "integer"), ("version", "integer"),
)
_CREDIT_COLS: tuple[tuple[str, str], ...] = (
    ("credits_held", "bigint"), ("credits_charged", "bigint"), ("credits_released", "bigint"),
    ("credits_shortfall", "bigint"), ("last_seq", "bigint"),
)
_QUEUE_COLS: tuple[tuple[str, str], ...] = (
    ("lease_id", "text"), ("pool", "text"), ("tenant", "text"), ("priority_class", "text"),
    ("state", "text"), ("shape", "jsonb"), ("attempts", "integer"),
    ("requested_at", "float8"), ("queued_at", "float8"), ("last_seq", "bigint"),
)
_BALANCE_COLS: tuple[tuple[str, str], ...] = (
    ("tenant", "text"), ("granted", "bigint"), ("held", "bigint"), ("spent", "bigint"),
    ("available", "bigint"), ("shortfall", "bigint"), ("holds", "integer"),
    ("version", "integer"), ("last_seq", "bigint"),
)
_CAPACITY_COLS: tuple[tuple[str, str], ...] = (
    ("node_id", "text"), ("pool", "text"), ("state", "text"), ("state_reason", "text"),
    ("zone", "text"), ("failure_domain", "text"), ("gpu_model", "text"),
    *((f"{d}_{k}", "bigint") for d in DIMENSIONS for k in ("allocatable", "allocated")),
    ("extended_allocatable", "jsonb"), ("extended_allocated", "jsonb"),
    ("allocations", "integer"), ("last_heartbeat_at", "float8"), ("version", "integer"),
    ("last_seq", "bigint"),
)


def _upsert_sql(schema: str, table: str, cols: Sequence[tuple[str, str]],
                sets: Sequence[str]) -> sql.Composed:
    """INSERT INTO schema.table (cols) SELECT <each column from its place in a row> FROM
    jsonb_array_elements(%s) ON CONFLICT (first col) DO UPDATE SET <sets>, where each of `sets`
    is raw SQL with {t} for the table; the parameter is the rows as one JSON array of arrays."""
    t = sql.Identifier(schema, table)
    return sql.SQL(
        "INSERT INTO {t} ({cols}) SELECT {values} FROM jsonb_array_elements(%s::jsonb) AS r "
        "ON CONFLICT ({key}) DO UPDATE SET {sets}"
    ).format(
        t=t,
        cols=sql.SQL(", ").join(sql.Identifier(c) for c, _ in cols),
        values=sql.SQL(", ").join(
            sql.SQL(f"(r->{i})" if typ == "jsonb" else f"(r->>{i})::{typ}")
            for i, (_, typ) in enumerate(cols)),
        key=sql.Identifier(cols[0][0]),
        sets=sql.SQL(", ").join(sql.SQL(s).format(t=t) for s in sets),
    )


def _set_excluded(names: Iterable[str]) -> list[str]:
    return [f'"{n}" = EXCLUDED."{n}"' for n in names]


_CREDIT_SETS = [f'{c} = {{t}}.{c} + EXCLUDED.{c}' for c, _ in _CREDIT_COLS[:-1]] + [
    "last_seq = GREATEST({t}.last_seq, EXCLUDED.last_seq)"]

_SQL_CACHE: dict[tuple[str, str], sql.Composed] = {}


def _stmt(schema: str, kind: str) -> sql.Composed:
    got = _SQL_CACHE.get((schema, kind))
    if got is None:
        if kind == "leases":  # lease state (replaced) + credit deltas (added)
            got = _upsert_sql(schema, "leases", _LEASE_STATE_COLS + _CREDIT_COLS,
                              _set_excluded(c for c, _ in _LEASE_STATE_COLS[1:]) + _CREDIT_SETS)
        elif kind == "credits":  # credit deltas only, for leases with no state in the batch
            got = _upsert_sql(schema, "leases", (("lease_id", "text"), ("tenant", "text"),
                                                 *_CREDIT_COLS), _CREDIT_SETS)
        elif kind == "queue":
            got = _upsert_sql(schema, "queue", _QUEUE_COLS,
                              _set_excluded(c for c, _ in _QUEUE_COLS[1:]))
        elif kind == "positions":
            got = _fmt("SELECT view_name, notification_id, events_applied FROM {s}.tracking "
                       "FOR UPDATE", schema)
        elif kind == "tracking":
            got = _fmt("UPDATE {s}.tracking AS t SET notification_id = u.n, "
                       "events_applied = u.a, updated_at = now() FROM unnest("
                       "%s::text[], %s::bigint[], %s::bigint[]) AS u(v, n, a) "
                       "WHERE t.view_name = u.v", schema)
        elif kind == "queue_delete":
            got = _fmt("DELETE FROM {s}.queue WHERE lease_id = ANY(%b::text[])", schema)
        elif kind == "balance":
            got = _upsert_sql(schema, "balance", _BALANCE_COLS,
                              _set_excluded(c for c, _ in _BALANCE_COLS[1:]))
        elif kind == "capacity":
            got = _upsert_sql(schema, "capacity", _CAPACITY_COLS,
                              _set_excluded(c for c, _ in _CAPACITY_COLS[1:]))
        else:  # pragma: no cover
            raise KeyError(kind)
        if len(_SQL_CACHE) > 1000:
            _SQL_CACHE.clear()
        _SQL_CACHE[(schema, kind)] = got
    return got


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Row tuples → one list per column (the unnest arrays)."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(c) for c in zip(*rows)]


def _emit_rows(emit: Any, kind: str, rows: Sequence[Sequence[Any]]) -> None:
    if rows:
        emit(kind, (_encode_json(rows).decode(),))


def _lease_state_row(lease: Lease) -> tuple[Any, ...]:
    return (
        str(lease.id), lease.tenant_id, lease.pool_id, str(lease.state), lease.node_id,
        lease.priority_class, lease.shape.to_dict(), lease.epoch, lease.attempts,
        lease.maximum_runtime_seconds, _f(lease.requested_at), _f(lease.queued_at),
        _f(lease.reserved_at), _f(lease.started_at), _f(lease.run_ended_at),
        _f(lease.ended_at), _f(lease.deadline), _f(lease.last_heartbeat_at),
        lease.hold_microcredits, lease.end_reason, lease.exit_code, lease.version,
    )


def _queue_row(lease: Lease, state: str, seq: int) -> tuple[Any, ...]:
    return (str(lease.id), lease.pool_id, lease.tenant_id, lease.priority_class, state,
            lease.requested_shape.to_dict(), lease.attempts, _f(lease.requested_at),
            _f(lease.queued_at), seq)


def _account_row(acc: Account, seq: int) -> tuple[Any, ...]:
    return (acc.tenant_id, acc.granted, acc.held, acc.spent, acc.available, acc.shortfall,
            len(acc.holds), acc.version, seq)


def _node_row(node: Node, seq: int) -> tuple[Any, ...]:
    caps = node.capabilities
    alloc = node.allocated
    allocatable = node.allocatable
    dims: list[Any] = []
    for d in DIMENSIONS:
        dims += [getattr(allocatable, d), getattr(alloc, d)]
    return (node.node_id, node.pool_id, str(node.state), node.state_reason, caps.zone,
            caps.failure_domain, caps.gpu_model, *dims, dict(allocatable.extended),
            dict(alloc.extended), len(node.allocations), _f(node.last_heartbeat_at),
            node.version, seq)


# -- the projection ----------------------------------------------------------------------------

_LEASE, _ACCOUNT, _NODE, _OTHER = 1, 2, 3, 4


@dataclass
class Prepared:
    """A folded batch's statements for views at `expected` (see PoolViews.prepare)."""

    expected: dict[str, tuple[int, int]]  # view → (position, events applied) it was built for
    after: dict[str, tuple[int, int]]  # the same once it is written
    statements: list[tuple[str, Any]]  # (statement kind, parameters), in write order
    tracked: list[tuple[str, int, int]]  # (view, new position, events applied)
    taken: int  # what process() returns for it


class _Slice:
    """What one batch (from one position on) changed, as `PoolViews._slice` coalesced it."""

    __slots__ = ("accounts", "count", "credits", "last_seq", "leases", "nodes")

    def __init__(self, count: int, last_seq: int) -> None:
        self.count = count  # events in the slice
        self.last_seq = last_seq  # the notification id of its last event
        self.leases: list[tuple[int, Lease]] = []  # (seq of its last event, final lease)
        self.accounts: list[tuple[int, Account]] = []
        self.nodes: list[tuple[int, Node]] = []
        # (seq, tenant, lease id, held, charged, released, shortfall deltas) per credit event of
        # an account, in log order
        self.credits: list[tuple[int, str, str, int, int, int, int]] = []


class PoolViews:
    """The four views of one schema, fed by the "pool" application `app` (its recorder reads
    JetStream). `process(notifications)` applies one batch in one transaction."""

    def __init__(self, app: Any, database_url: str, *, schema: str = DEFAULT_SCHEMA,
                 views: Sequence[str] = VIEWS) -> None:
        self.app = app
        self.database_url = database_url
        self.schema = schema
        self.views = tuple(check_view(v) for v in views)
        self._write_order = sorted(self.views, key=lambda v: v != "leases")
        self.folder = Folder(app)
        self.decode = EventDecoder(app.mapper)
        self._kinds: dict[type, int] = {}
        self._credit_extractors: dict[type, Any] = {}
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
        return min((at for at, _ in self.view_positions().values()), default=0)

    def view_positions(self) -> dict[str, tuple[int, int]]:
        """view → (notification_id, events_applied) of this projection's views, as committed
        now (0, 0 for a view not created yet)."""
        pos = positions(self.conn, self.schema)
        self.conn.commit()
        return {v: pos.get(v, (0, 0)) for v in self.views}

    def process(self, notifications: Sequence[Any], *, read_from: int | None = None,
                prepared: Prepared | None = None) -> int:
        """Apply one batch; returns how many events some view took (0: all already applied).

        `read_from`: where the batch was read from, after the views' position then. A view now
        behind that was rebuilt meanwhile: nothing is written, and PositionMoved is raised so
        the caller reads again from the view's position instead of leaving a gap.

        `prepared`: the batch as `prepare` folded it and built its rows, for the positions it
        names; it is written only if the views are exactly there (else PositionMoved), and the
        in-memory fold is left alone (the caller clears it on any error: see `prepare`)."""
        if prepared is not None:
            return self._write_prepared(prepared)
        if not notifications:
            return 0
        folded = self._fold(notifications)
        conn = self.conn
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(self.schema),))
                pos = positions(conn, self.schema, lock=True)
                if read_from is not None and any(
                        pos.get(v, (0, 0))[0] < read_from - 1 for v in self.views):
                    raise PositionMoved(f"a view moved back before position {read_from - 1}")
                # the writes go out in pipeline mode: PostgreSQL works on one view's statement
                # while the next one's rows are built here, and nothing waits on a reply until
                # the pipeline's end; the heaviest view (leases) goes first
                with conn.pipeline():  # its end waits for every statement's result
                    schema = self.schema
                    tracked, taken = self._plan(
                        folded, pos, lambda kind, params: conn.execute(_stmt(schema, kind), params))
                    if tracked:
                        conn.execute(_stmt(schema, "tracking"), _columns(tracked, 3))
            self.folder.forget_finished(folded)
            return taken
        except Exception:
            # the view rolled back; the in-memory fold is ahead of nothing useful now
            self.folder.clear()
            raise

    def prepare(self, notifications: Sequence[Any],
                pos: dict[str, tuple[int, int]]) -> Prepared:
        """Fold a batch and build its rows for views at positions `pos` (view → (position,
        events applied)), without touching the database: `process(..., prepared=)` writes them
        later, in one transaction, if the views are still there. The rows are final when this
        returns, so the next batch may be folded (and its aggregates mutated) meanwhile; should
        a write then fail, the caller must `folder.clear()`, the fold being ahead of the views."""
        if not notifications:
            raise ValueError("nothing to prepare")
        folded = self._fold(notifications)
        statements: list[tuple[str, Any]] = []
        try:
            tracked, taken = self._plan(folded, pos, lambda kind, params: statements.append(
                (kind, params)))
            self.folder.forget_finished(folded)
        except Exception:
            self.folder.clear()
            raise
        expected = {v: pos.get(v, (0, 0)) for v in self.views}
        after = dict(expected)
        for view, at, applied in tracked:
            after[view] = (at, applied)
        return Prepared(expected, after, statements, tracked, taken)

    def _write_prepared(self, prepared: Prepared) -> int:
        """One transaction, pipelined: two round trips (the positions under the lock, then the
        rows, the positions and the commit)."""
        conn, schema = self.conn, self.schema
        with conn.pipeline() as pipe, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(schema),))
            cur = conn.execute(_stmt(schema, "positions"))
            pipe.sync()
            pos = {r[0]: (int(r[1]), int(r[2])) for r in cur.fetchall()}
            if any(pos.get(v, (0, 0)) != at for v, at in prepared.expected.items()):
                raise PositionMoved("a view moved after the batch was prepared")
            for kind, params in prepared.statements:
                conn.execute(_stmt(schema, kind), params)
            if prepared.tracked:
                conn.execute(_stmt(schema, "tracking"), _columns(prepared.tracked, 3))
        return prepared.taken

    def _fold(self, notifications: Sequence[Any]) -> list[tuple[int, Any, Any]]:
        decode, apply = self.decode, self.folder.apply
        try:
            return [(n.id, ev, apply(ev)) for n in notifications for ev in (decode(n),)]
        except Exception:
            self.folder.clear()
            raise

    def _plan(self, folded: list[tuple[int, Any, Any]], pos: dict[str, tuple[int, int]],
              emit: Any) -> tuple[list[tuple[str, int, int]], int]:
        """Each view's statements for a folded batch, given the views' positions, passed to
        `emit(kind, params)` as they are built; returns the new positions and the count taken."""
        taken = 0
        tracked: list[tuple[str, int, int]] = []
        # views at the same position share one slice of the batch and one coalescing
        shared: dict[int, _Slice] = {}
        for view in self._write_order:
            at, applied = pos.get(view, (0, 0))
            got = shared.get(at)
            if got is None:
                fresh = folded if folded[0][0] > at else [f for f in folded if f[0] > at]
                got = shared[at] = self._slice(fresh)
            if not got.count:
                continue
            taken = max(taken, got.count)
            self._statements(view, got, emit)
            tracked.append((view, got.last_seq, applied + got.count))
        return tracked, taken

    def _kind(self, cls: type) -> int:
        kinds = self._kinds
        got = kinds.get(cls)
        if got is None:
            got = kinds[cls] = (_LEASE if issubclass(cls, Lease) else _ACCOUNT
                                if issubclass(cls, Account) else _NODE
                                if issubclass(cls, Node) else _OTHER)
        return got

    def _slice(self, fresh: list[tuple[int, Any, Any]]) -> _Slice:
        """A batch's events from one position on, coalesced per aggregate: each aggregate touched
        with the position of its last event, by kind (the aggregates are the folded objects,
        final for this batch), and the credit events of accounts in log order."""
        out = _Slice(len(fresh), fresh[-1][0] if fresh else 0)
        # keyed by object: a folded aggregate is one object for as long as it is cached, and a
        # reload (a cache miss) makes a new object whose first event comes after the old one's
        # last, so per key, in first-seen order, the later object's row is written last
        last = {id(agg): (seq, agg) for seq, _ev, agg in fresh}
        kinds = self._kinds
        extractors = self._credit_extractors
        credits = out.credits
        for seq, ev, agg in fresh:
            cls = type(ev)
            extract = extractors.get(cls, _UNSEEN)
            if extract is None:
                continue
            if extract is _UNSEEN:
                extract = extractors[cls] = _credit_extractor(cls)
                if extract is None:
                    continue
            if (kinds.get(type(agg)) or self._kind(type(agg))) == _ACCOUNT:
                tenant = agg.tenant_id
                for moved in extract(ev):
                    credits.append((seq, tenant, *moved))
        by_kind: dict[int, list[Any]] = {_LEASE: out.leases, _ACCOUNT: out.accounts,
                                         _NODE: out.nodes}
        for seq, agg in last.values():
            cls = type(agg)
            rows = by_kind.get(kinds.get(cls) or self._kind(cls))
            if rows is not None:
                rows.append((seq, agg))
        return out

    def _statements(self, view: str, got: _Slice, emit: Any) -> None:
        """A slice's changes to `view`, one row per key, as statements: `emit(kind, params)`."""
        if view == "leases":
            rows: dict[str, list[Any]] = {}
            for seq, agg in got.leases:
                rows[str(agg.id)] = [*_lease_state_row(agg), 0, 0, 0, 0, seq]
            credit_only: dict[str, list[Any]] = {}
            for seq, tenant, lid, h, ch, rel, sh in got.credits:
                row = rows.get(lid)
                if row is None:
                    row = credit_only.get(lid)
                    if row is None:
                        credit_only[lid] = [lid, tenant, h, ch, rel, sh, seq]
                        continue
                row[-5] += h
                row[-4] += ch
                row[-3] += rel
                row[-2] += sh
                row[-1] = max(row[-1], seq)
            _emit_rows(emit, "leases", list(rows.values()))
            _emit_rows(emit, "credits", list(credit_only.values()))
        elif view == "queue":
            waiting: dict[str, tuple[Any, ...]] = {}
            gone: dict[str, None] = {}
            for seq, agg in got.leases:
                state = str(agg.state)
                key = str(agg.id)
                if state in WAITING_STATES:
                    gone.pop(key, None)
                    waiting[key] = _queue_row(agg, state, seq)
                else:
                    waiting.pop(key, None)
                    gone[key] = None
            _emit_rows(emit, "queue", list(waiting.values()))
            if gone:
                emit("queue_delete", (list(gone),))
        elif view == "balance":
            accounts: dict[str, tuple[Any, ...]] = {}
            for seq, acc in got.accounts:
                accounts[acc.tenant_id] = _account_row(acc, seq)
            _emit_rows(emit, "balance", list(accounts.values()))
        elif view == "capacity":
            nodes: dict[str, tuple[Any, ...]] = {}
            for seq, node in got.nodes:
                nodes[node.node_id] = _node_row(node, seq)
            _emit_rows(emit, "capacity", list(nodes.values()))

    def catch_up(self, *, batch_size: int = DEFAULT_BATCH, stop: int | None = None) -> int:
        """Apply every batch up to the log's end (or `stop`); returns the events applied. The
        next batch is read while the current one is applied, and folded (`prepare`) while the
        previous one is written by a writer thread, each sent after the previous one committed
        (as the projector does)."""
        total = 0
        with concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pool-views-writer") as writer:
            while True:
                pos = self.view_positions()
                start = min((at for at, _ in pos.values()), default=0) + 1
                if stop is not None and start > stop:
                    return total
                inflight: concurrent.futures.Future[int] | None = None
                try:
                    for page in read_pages(self.app.recorder, start, batch_size, stop=stop):
                        prepared = self.prepare(page, pos)
                        if inflight is not None:
                            total += inflight.result()
                        inflight = writer.submit(self.process, page, prepared=prepared)
                        pos = prepared.after
                    if inflight is not None:
                        total += inflight.result()
                    return total
                except BaseException as exc:
                    if inflight is not None:  # wait for it: the connection is its until then
                        with contextlib.suppress(Exception):
                            total += inflight.result()
                    self.folder.clear()  # the fold may be ahead of what was written
                    if not isinstance(exc, PositionMoved):
                        raise


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cycle collector off for a bounded fold of the whole log (a rebuild, the audit).

    Such a fold keeps many objects alive (aggregates, per-lease figures) and makes (almost) no
    reference cycles, so the collector would only re-scan a growing heap (figures:
    docs/performance.md). Any cyclic garbage of other threads waits for the end; the previous
    setting comes back."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_pages(recorder: Any, start: int, batch_size: int,
               stop: int | None = None) -> Iterator[Sequence[Any]]:
    """Pages of notifications from `start` up to the end of the log (or `stop`); while the
    caller works on one page the next is already being read, when the recorder can read ahead
    (bus.jetstream's `prefetch`), else pages are read one after the other."""
    prefetch = getattr(recorder, "prefetch", None)

    def fetch(at: int) -> Any:
        if prefetch is not None:
            return prefetch(at, batch_size, stop)
        done: concurrent.futures.Future[Sequence[Any]] = concurrent.futures.Future()
        done.set_result(recorder.select_notifications(at, batch_size, stop=stop))
        return done

    ahead = fetch(start)
    while True:
        page = ahead.result()
        if not page:
            return
        if stop is not None and page[-1].id >= stop:
            yield page
            return
        ahead = fetch(page[-1].id + 1)
        yield page


# -- status and rebuild --------------------------------------------------------------------------


def positions_at(database_url: str, schema: str = DEFAULT_SCHEMA) -> dict[str, tuple[int, int]]:
    """`positions` for callers outside projections/, which hold a URL, not a connection."""
    with psycopg.connect(database_url) as conn:
        return positions(conn, schema)


def drop_schema(database_url: str, schema: str) -> None:
    """Drop a whole views schema (benchmarks and tests use throwaway ones)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


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
    with psycopg.connect(database_url) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(schema),))
        conn.execute(_fmt("CREATE SCHEMA IF NOT EXISTS {s}", schema))
        conn.execute(_fmt(TRACKING_DDL, schema))
        for v in names:
            drop_view(conn, schema, v)
        create_schema(conn, schema, names)
    proj = PoolViews(app, database_url, schema=schema, views=names)
    try:
        with gc_paused():
            return proj.catch_up(batch_size=batch_size,
                                 stop=app.recorder.max_notification_id() or 0)
    finally:
        proj.close()


def dump(database_url: str, schema: str, view: str) -> list[tuple[Any, ...]]:
    """Every row of a view, ordered by key, for comparing a live view with a rebuilt one."""
    key = {"queue": "lease_id", "balance": "tenant", "capacity": "node_id",
           "leases": "lease_id"}[check_view(view)]
    with psycopg.connect(database_url) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {} ORDER BY {}").format(
            sql.Identifier(schema, view), sql.Identifier(key))).fetchall()
