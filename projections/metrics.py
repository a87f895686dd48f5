"""Prometheus metrics read from the views at scrape time: leases, queue, nodes, capacity,
credits, request → reserved and the projector's position. Labels: pool, tenant, state only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from psycopg import sql

from projections.views import DEFAULT_SCHEMA
from projections.views.schema import DIMENSIONS

log = logging.getLogger(__name__)

# request → reserved, in seconds (a placement waits milliseconds on an idle pool, hours on a
# full one)
WAIT_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300,
                                   900, 3600, 4 * 3600, 24 * 3600)
_NOT_ALLOCATABLE = ("lost",)  # a lost node's capacity is no one's to place on


def _q(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(schema))


class ViewsCollector(Collector):
    """A custom collector: each scrape runs a few aggregate queries on the views (one kept
    connection, under a lock) and reports them; `log_head` (the log's last sequence, None when
    the bus does not answer) adds the log sequence and each view's lag behind it."""

    def __init__(self, database_url: str, schema: str = DEFAULT_SCHEMA, *,
                 log_head: Callable[[], int | None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.database_url = database_url
        self.schema = schema or DEFAULT_SCHEMA
        self.log_head = log_head
        self.clock = clock
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time: registering must not query

    def collect(self) -> Iterator[Metric]:
        head: int | None = None
        if self.log_head is not None:
            try:
                head = self.log_head()
            except Exception as e:  # noqa: BLE001 - the bus may be away; the views still answer
                log.debug("the log's head is unknown: %r", e)
        if head is not None:
            g = GaugeMetricFamily("pool_log_sequence", "the event log's last sequence")
            g.add_metric([], head)
            yield g
        up = GaugeMetricFamily("pool_views_up", "1 when the views' database answered this scrape")
        try:
            families = self._read(head)
        except psycopg.Error as e:
            log.warning("metrics: the views could not be read: %s", e)
            self.close()
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _read(self, head: int | None) -> list[Metric]:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.database_url, connect_timeout=5,
                                             autocommit=True)
            conn = self._conn
            try:
                return self._families(conn, head)
            except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
                return []  # no views built yet: nothing to report but pool_views_up

    def _families(self, conn: psycopg.Connection[Any], head: int | None) -> list[Metric]:
        s = self.schema
        out: list[Metric] = []
        leases = GaugeMetricFamily("pool_leases", "leases by pool and state (the leases view)",
                                   labels=["pool", "state"])
        for pool, state, n in conn.execute(_q(
                "SELECT coalesce(pool, ''), coalesce(state, ''), count(*) FROM {s}.leases "
                "GROUP BY 1, 2 ORDER BY 1, 2", s)):
            leases.add_metric([pool, state], n)
        out.append(leases)

        depth = GaugeMetricFamily("pool_queue_depth",
                                  "waiting requests by pool and tenant (the queue view)",
                                  labels=["pool", "tenant"])
        oldest = GaugeMetricFamily("pool_queue_oldest_wait_seconds",
                                   "how long the oldest waiting request has waited",
                                   labels=["pool", "tenant"])
        now = self.clock()
        for pool, tenant, n, first in conn.execute(_q(
                "SELECT pool, tenant, count(*), min(requested_at) FROM {s}.queue "
                "GROUP BY 1, 2 ORDER BY 1, 2", s)):
            depth.add_metric([pool, tenant], n)
            oldest.add_metric([pool, tenant], max(0.0, now - float(first)))
        out += [depth, oldest]

        hist = HistogramMetricFamily(
            "pool_request_to_reserved_seconds",
            "from a lease's request to its reservation on a node, by pool (leases view); its "
            "_count is the placements made", labels=["pool"])
        cols = sql.SQL(", ").join(
            sql.SQL("count(*) FILTER (WHERE reserved_at - requested_at <= {})").format(
                sql.Literal(b)) for b in WAIT_BUCKETS)
        for row in conn.execute(sql.SQL(
                "SELECT coalesce(pool, ''), {cols}, count(*), "
                "coalesce(sum(greatest(reserved_at - requested_at, 0)), 0) "
                "FROM {t} WHERE reserved_at IS NOT NULL GROUP BY 1 ORDER BY 1").format(
                    cols=cols, t=sql.Identifier(s, "leases"))):
            pool, counts, total, seconds = row[0], row[1:-2], row[-2], row[-1]
            buckets = [(str(b), c) for b, c in zip(WAIT_BUCKETS, counts, strict=True)]
            hist.add_metric([pool], [*buckets, ("+Inf", total)], float(seconds))
        out.append(hist)

        nodes = GaugeMetricFamily("pool_nodes", "nodes by pool and state (the capacity view)",
                                  labels=["pool", "state"])
        for pool, state, n in conn.execute(_q(
                "SELECT pool, state, count(*) FROM {s}.capacity GROUP BY 1, 2 ORDER BY 1, 2",
                s)):
            nodes.add_metric([pool, state], n)
        out.append(nodes)

        allocatable = GaugeMetricFamily(
            "pool_capacity_allocatable", "what nodes that are not lost offer, by pool and "
            "resource (cpu_millis, memory_mib, gpu_count, local_disk_gib)",
            labels=["pool", "resource"])
        allocated = GaugeMetricFamily("pool_capacity_allocated",
                                      "what leases hold of it, by pool and resource",
                                      labels=["pool", "resource"])
        sums = sql.SQL(", ").join(
            sql.SQL("sum({a}), sum({b})").format(a=sql.Identifier(f"{d}_allocatable"),
                                                 b=sql.Identifier(f"{d}_allocated"))
            for d in DIMENSIONS)
        for row in conn.execute(sql.SQL(
                "SELECT pool, {sums} FROM {t} WHERE state <> ALL(%s) GROUP BY 1 "
                "ORDER BY 1").format(sums=sums, t=sql.Identifier(s, "capacity")),
                (list(_NOT_ALLOCATABLE),)):
            for i, d in enumerate(DIMENSIONS):
                allocatable.add_metric([row[0], d], int(row[1 + 2 * i] or 0))
                allocated.add_metric([row[0], d], int(row[2 + 2 * i] or 0))
        out += [allocatable, allocated]

        spent = CounterMetricFamily("pool_credits_spent_microcredits",
                                    "micro-credits charged to each tenant (the balance view)",
                                    labels=["tenant"])
        held = GaugeMetricFamily("pool_credits_held_microcredits",
                                 "micro-credits held for running leases", labels=["tenant"])
        for tenant, s_, h in conn.execute(_q(
                "SELECT tenant, spent, held FROM {s}.balance ORDER BY 1", s)):
            spent.add_metric([tenant], s_)
            held.add_metric([tenant], h)
        out += [spent, held]

        position = GaugeMetricFamily("pool_projection_position",
                                     "the log sequence each view has applied", labels=["view"])
        lag = GaugeMetricFamily("pool_projection_lag_events",
                                "events in the log not yet in each view", labels=["view"])
        for view, at in conn.execute(_q(
                "SELECT view_name, notification_id FROM {s}.tracking ORDER BY 1", s)):
            position.add_metric([view], at)
            if head is not None:
                lag.add_metric([view], max(0, head - int(at)))
        out.append(position)
        if head is not None:
            out.append(lag)
        return out


class LogHead(Collector):
    """The log's last sequence alone, for a process without the views' database."""

    def __init__(self, head: Callable[[], int | None]) -> None:
        self.head = head

    def collect(self) -> Iterator[Metric]:
        try:
            at = self.head()
        except Exception as e:  # noqa: BLE001 - the bus may be away: report nothing this time
            log.debug("the log's head is unknown: %r", e)
            return
        if at is not None:
            g = GaugeMetricFamily("pool_log_sequence", "the event log's last sequence")
            g.add_metric([], at)
            yield g


def views_or_head(database_url: str | None, schema: str = "", *,
                  log_head: Callable[[], int | None] | None = None) -> Collector | None:
    """What a process reports of the log: the views (read at scrape time, with the log's head
    for the lag) when it has a database, else the log's head alone; None: neither."""
    if database_url:
        return ViewsCollector(database_url, schema, log_head=log_head)
    if log_head is not None:
        return LogHead(log_head)
    return None


__all__ = ["WAIT_BUCKETS", "LogHead", "ViewsCollector", "views_or_head"]
