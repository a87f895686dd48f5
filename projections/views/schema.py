"""The views' tables: their DDL, names, positions, status, drop and dump."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import sql

from projections.errors import UnknownView
from projections.views.history import create_history, drop_history

APPLICATION_NAME = "pool"
DEFAULT_SCHEMA = "pool_views"


VIEWS: tuple[str, ...] = ("queue", "balance", "capacity", "leases")


DIMENSIONS: tuple[str, ...] = ("cpu_millis", "memory_mib", "gpu_count", "local_disk_gib")


WAITING_STATES = frozenset({"requested", "queued"})
DEFAULT_BATCH = 1000


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
            CREATE INDEX IF NOT EXISTS leases_tenant ON {s}.leases (tenant, lease_id);
            ALTER TABLE {s}.leases ADD COLUMN IF NOT EXISTS gang_id TEXT;
            ALTER TABLE {s}.leases ADD COLUMN IF NOT EXISTS gang_member INTEGER;
            CREATE INDEX IF NOT EXISTS leases_gang ON {s}.leases (gang_id)
                WHERE gang_id IS NOT NULL;
            ALTER TABLE {s}.leases ADD COLUMN IF NOT EXISTS name TEXT;
            ALTER TABLE {s}.leases ADD COLUMN IF NOT EXISTS labels JSONB NOT NULL
                DEFAULT '{{}}'::jsonb;
            """ + GANGS_DDL,
    }[view]


# A gang is one row with its members: derived from the leases view's rows in the same
# transaction, so it is exactly as current as the leases (nothing more to write or track).
GANGS_DDL = """CREATE OR REPLACE VIEW {s}.gangs AS
    SELECT gang_id, tenant, min(pool) AS pool, count(*)::integer AS size,
           CASE WHEN count(DISTINCT state) = 1 THEN min(state) ELSE 'mixed' END AS state,
           jsonb_agg(jsonb_build_object('member', gang_member, 'lease_id', lease_id,
                                        'state', state, 'node_id', node_id)
                     ORDER BY gang_member) AS members,
           min(requested_at) AS requested_at
    FROM {s}.leases WHERE gang_id IS NOT NULL GROUP BY gang_id, tenant"""
# views read like the tracked ones but derived from them: (view, the tracked view it reads)
DERIVED: dict[str, str] = {"gangs": "leases"}


def check_readable(name: str) -> str:
    """A view a query may read: a tracked one or one derived from them."""
    return name if name in DERIVED else check_view(name)


TRACKING_DDL = """CREATE TABLE IF NOT EXISTS {s}.tracking (
    view_name TEXT PRIMARY KEY, application_name TEXT NOT NULL,
    notification_id BIGINT NOT NULL, events_applied BIGINT NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now())"""


def check_view(name: str) -> str:
    if name not in VIEWS:
        raise UnknownView(f"no view {name!r}; views are {', '.join(VIEWS)}")
    return name


def formatted(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(schema))


def lock_key(schema: str) -> int:
    return zlib.crc32(f"computepool-views:{schema}".encode()) - 2**31


def create_schema(conn: psycopg.Connection[Any], schema: str, views: Iterable[str] = VIEWS) -> None:
    conn.execute(formatted("CREATE SCHEMA IF NOT EXISTS {s}", schema))
    conn.execute(formatted(TRACKING_DDL, schema))
    for v in views:
        for stmt in _ddl(check_view(v)).split(";"):
            conn.execute(formatted(stmt, schema))
        conn.execute(
            formatted("INSERT INTO {s}.tracking (view_name, application_name, notification_id, "
                 "events_applied) VALUES (%s, %s, 0, 0) ON CONFLICT (view_name) DO NOTHING",
                 schema),
            (v, APPLICATION_NAME),
        )
        create_history(conn, schema, v)


def drop_view(conn: psycopg.Connection[Any], schema: str, view: str) -> None:
    for derived, source in DERIVED.items():  # made again with their source
        if source == view:
            conn.execute(sql.SQL("DROP VIEW IF EXISTS {}.{}").format(
                sql.Identifier(schema), sql.Identifier(derived)))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}.{}").format(
        sql.Identifier(schema), sql.Identifier(check_view(view))))
    conn.execute(formatted("DELETE FROM {s}.tracking WHERE view_name = %s", schema), (view,))
    drop_history(conn, schema, view)


def positions(conn: psycopg.Connection[Any], schema: str, *, lock: bool = False) -> dict[str, tuple[int, int]]:
    """view → (notification_id, events_applied)."""
    q = "SELECT view_name, notification_id, events_applied FROM {s}.tracking"
    if lock:
        q += " FOR UPDATE"
    try:
        rows = conn.execute(formatted(q, schema)).fetchall()
    except psycopg.errors.UndefinedTable:
        return {}
    return {r[0]: (int(r[1]), int(r[2])) for r in rows}


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


def dump(database_url: str, schema: str, view: str) -> list[tuple[Any, ...]]:
    """Every row of a view, ordered by key, for comparing a live view with a rebuilt one."""
    key = {"queue": "lease_id", "balance": "tenant", "capacity": "node_id",
           "leases": "lease_id"}[check_view(view)]
    with psycopg.connect(database_url) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {} ORDER BY {}").format(
            sql.Identifier(schema, view), sql.Identifier(key))).fetchall()
