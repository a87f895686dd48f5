"""Aggregate reads of the views for dashboards: queue, capacity and balances at a glance.

Read-only; one short transaction per call. What `pool demo` shows live while it runs.
"""

from __future__ import annotations

from typing import Any

import psycopg

from projections.views import DEFAULT_SCHEMA


class Summary:
    """One connection, reused: `snapshot()` returns the dashboard's figures."""

    def __init__(self, database_url: str, schema: str = DEFAULT_SCHEMA) -> None:
        self.url = database_url
        self.schema = schema
        self._conn: psycopg.Connection[Any] | None = None

    def _c(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.url, autocommit=True)
        return self._conn

    def snapshot(self) -> dict[str, Any]:
        s = self.schema
        c = self._c()
        out: dict[str, Any] = {}
        try:
            out["queue"] = [dict(zip(("tenant", "priority_class", "waiting", "oldest_at"), r))
                            for r in c.execute(
                f'SELECT tenant, priority_class, count(*), min(coalesce(queued_at, requested_at))'
                f' FROM "{s}".queue GROUP BY tenant, priority_class ORDER BY tenant, '
                f'priority_class').fetchall()]
            out["capacity"] = [dict(zip(
                ("pool", "nodes", "ready", "cordoned", "lost", "cpu_alloc", "cpu_used",
                 "gpu_alloc", "gpu_used", "mem_alloc", "mem_used"), r)) for r in c.execute(
                f"SELECT pool, count(*), count(*) FILTER (WHERE state = 'ready'), "
                f"count(*) FILTER (WHERE state IN ('cordoned', 'draining', 'maintenance')), "
                f"count(*) FILTER (WHERE state = 'lost'), "
                f"sum(cpu_millis_allocatable), sum(cpu_millis_allocated), "
                f"sum(gpu_count_allocatable), sum(gpu_count_allocated), "
                f"sum(memory_mib_allocatable), sum(memory_mib_allocated) "
                f'FROM "{s}".capacity GROUP BY pool ORDER BY pool').fetchall()]
            out["balance"] = [dict(zip(("tenant", "granted", "held", "spent", "available"), r))
                              for r in c.execute(
                f'SELECT tenant, granted, held, spent, available FROM "{s}".balance '
                f'ORDER BY tenant').fetchall()]
            out["leases"] = [dict(zip(("tenant", "state", "n"), r)) for r in c.execute(
                f'SELECT tenant, state, count(*) FROM "{s}".leases GROUP BY tenant, state '
                f'ORDER BY tenant, state').fetchall()]
            out["usage"] = [dict(zip(("tenant", "cpu_core_seconds", "gpu_seconds"), r))
                            for r in c.execute(
                f"SELECT tenant, coalesce(sum((shape->'resources'->>'cpu_millis')::float / 1000"
                f" * (coalesce(run_ended_at, ended_at) - started_at)), 0), "
                f"coalesce(sum((shape->'resources'->>'gpu_count')::float"
                f" * (coalesce(run_ended_at, ended_at) - started_at)), 0) "
                f'FROM "{s}".leases WHERE started_at IS NOT NULL AND '
                f"coalesce(run_ended_at, ended_at) IS NOT NULL GROUP BY tenant ORDER BY tenant"
            ).fetchall()]
        except psycopg.errors.UndefinedTable:
            return {}  # the projector has not built the views yet
        return out

    def running_cores(self, pool: str) -> dict[str, float]:
        """Cores held by running leases, per tenant, in `pool`."""
        rows = self._c().execute(
            f"SELECT tenant, sum((shape->'resources'->>'cpu_millis')::float / 1000) "
            f'FROM "{self.schema}".leases WHERE state = %s AND pool = %s GROUP BY tenant',
            ("running", pool)).fetchall()
        return {r[0]: float(r[1]) for r in rows}

    def states(self, lease_ids: list[str]) -> dict[str, str]:
        """The current state of each listed lease, as the leases view has it."""
        if not lease_ids:
            return {}
        try:
            rows = self._c().execute(
                f'SELECT lease_id, state FROM "{self.schema}".leases WHERE lease_id = ANY(%s)',
                (lease_ids,)).fetchall()
        except psycopg.errors.UndefinedTable:
            return {}
        return {r[0]: r[1] for r in rows}

    def position(self) -> int:
        """The lowest log position any view has reached (0 before the views exist)."""
        try:
            row = self._c().execute(
                f'SELECT min(notification_id) FROM "{self.schema}".tracking').fetchone()
        except psycopg.errors.UndefinedTable:
            return 0
        return int(row[0]) if row and row[0] is not None else 0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
