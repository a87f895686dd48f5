"""Reads of the views: what `pool.cmd.<tenant>.query.<view>` and the CLI tables answer.

A tenant's query always carries `tenant = <its own name>` in SQL; filters are limited to named
columns, values are bound parameters, and paging is keyset on the view's key (the cursor is the
last key of the previous page).
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from projections.views import DEFAULT_SCHEMA, check_view

KEYS = {"queue": "lease_id", "balance": "tenant", "capacity": "node_id", "leases": "lease_id"}
FILTERS = {
    "queue": ("pool", "priority_class", "state", "lease_id"),
    "balance": (),
    "capacity": ("pool", "state", "zone", "failure_domain", "gpu_model", "node_id"),
    "leases": ("pool", "state", "node_id", "priority_class", "lease_id"),
}
COLUMNS = {
    "queue": ("lease_id", "tenant", "pool", "priority_class", "state", "attempts",
              "requested_at", "queued_at", "shape"),
    "balance": ("tenant", "granted", "held", "spent", "available", "shortfall", "holds"),
    "capacity": ("node_id", "pool", "state", "zone", "failure_domain", "gpu_model",
                 "cpu_millis_allocatable", "cpu_millis_allocated", "memory_mib_allocatable",
                 "memory_mib_allocated", "gpu_count_allocatable", "gpu_count_allocated",
                 "local_disk_gib_allocatable", "local_disk_gib_allocated",
                 "extended_allocatable", "extended_allocated", "allocations",
                 "last_heartbeat_at"),
    "leases": ("lease_id", "tenant", "pool", "state", "node_id", "priority_class", "epoch",
               "attempts", "shape", "requested_at", "reserved_at", "started_at",
               "run_ended_at", "ended_at", "deadline", "hold_microcredits", "credits_held",
               "credits_charged", "credits_released", "credits_shortfall", "end_reason",
               "exit_code"),
}
TENANT_VIEWS = ("queue", "balance", "leases")


class ViewsUnavailable(Exception):
    """The views' database could not answer (down, or the views not built yet)."""

    code = "views_unavailable"


class BadQuery(Exception):
    """A filter on a column the view does not offer."""

    code = "invalid_field"


def query(conn: psycopg.Connection[Any], view: str, *, tenant: str | None,
          filters: dict[str, str] | None = None, limit: int = 100, cursor: str | None = None,
          schema: str = DEFAULT_SCHEMA) -> dict[str, Any]:
    """One page of a view: {"view", "rows", "next_cursor"}; `tenant` None reads every tenant."""
    check_view(view)
    key = KEYS[view]
    where: list[sql.Composable] = []
    params: list[Any] = []
    if tenant is not None:
        where.append(sql.SQL("tenant = %s"))
        params.append(tenant)
    for name, value in sorted((filters or {}).items()):
        if name not in FILTERS[view]:
            raise BadQuery(f"view {view} cannot be filtered on {name!r}; "
                           f"it offers {', '.join(FILTERS[view]) or 'no filters'}")
        where.append(sql.SQL("{} = %s").format(sql.Identifier(name)))
        params.append(value)
    if cursor:
        where.append(sql.SQL("{} > %s").format(sql.Identifier(key)))
        params.append(cursor)
    stmt = sql.SQL("SELECT {cols} FROM {t}{w} ORDER BY {k} LIMIT %s").format(
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS[view])),
        t=sql.Identifier(schema, view),
        w=(sql.SQL(" WHERE ") + sql.SQL(" AND ").join(where)) if where else sql.SQL(""),
        k=sql.Identifier(key),
    )
    params.append(limit + 1)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(stmt, params).fetchall()
    conn.commit()
    more = len(rows) > limit
    rows = rows[:limit]
    return {"view": view, "rows": rows,
            "next_cursor": str(rows[-1][key]) if more and rows else None}


class ViewReader:
    """One lazily opened connection, shared under a lock (the command service has threads)."""

    def __init__(self, database_url: str, schema: str = DEFAULT_SCHEMA) -> None:
        self.database_url = database_url
        self.schema = schema
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def query(self, view: str, **kw: Any) -> dict[str, Any]:
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = psycopg.connect(self.database_url, connect_timeout=5)
                    return query(self._conn, view, schema=self.schema, **kw)
                except psycopg.OperationalError:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    if attempt == 2:
                        raise ViewsUnavailable("the views' database is unreachable") from None
                except psycopg.Error as e:
                    if self._conn is not None:
                        self._conn.rollback()
                    raise ViewsUnavailable(f"the views could not be read: {e}") from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def query_url(database_url: str, view: str, **kwargs: Any) -> dict[str, Any]:
    """`query` for callers outside projections/ (the CLI), which hold a URL, not a connection."""
    with psycopg.connect(database_url) as conn:
        return query(conn, view, **kwargs)
