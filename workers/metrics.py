"""A plane process's Prometheus endpoint (`--metrics-port`): its in-process counters (placements,
request → reserved, webhook deliveries), the log's sequence, and the views where it has them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

# request → reserved, in seconds (projections.metrics.WAIT_BUCKETS: the same buckets, so the
# plane's histogram and the views' read alike)
WAIT_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300,
                                   900, 3600, 4 * 3600, 24 * 3600)

# the process's own counters: one set per process, however many planes it runs (tests run
# several; a process serves one endpoint in production)
PROCESS = CollectorRegistry(auto_describe=True)
PLACEMENTS = Counter("pool_scheduler_placements", "leases this process's scheduler placed "
                     "(saved reservations), by pool; its rate is placements/s", ["pool"],
                     registry=PROCESS)
WAITED = Histogram("pool_scheduler_request_to_reserved_seconds",
                   "from a lease's request to the reservation this process's scheduler saved",
                   ["pool"], buckets=WAIT_BUCKETS, registry=PROCESS)
CYCLE_OUTCOMES = Counter("pool_scheduler_cycle_outcomes", "per scheduling cycle: rejected, "
                         "voided, expired and preempted leases, refused batches", ["outcome"],
                         registry=PROCESS)
WEBHOOK_DELIVERIES = Counter("pool_webhook_deliveries", "webhook POSTs by outcome (delivered, "
                             "retried, failed: given up)", ["outcome"], registry=PROCESS)
WEBHOOK_PENDING = Gauge("pool_webhook_pending", "webhook deliveries waiting or in flight",
                        registry=PROCESS)
REFUSALS = Counter("pool_command_refusals", "commands this process refused, by stable error "
                   "code (queue_limit_exceeded, quota_exceeded, webhook_limit: limits hit)",
                   ["code"], registry=PROCESS)
LIMITS_HIT = Counter("pool_webhook_limits_hit", "webhook records held back by a tenant's "
                     "in-flight cap", registry=PROCESS)


def placed_many(placements: Iterable[tuple[str, float]]) -> None:
    """A saved batch's placements, (pool, waited seconds) each: each counted, and how long its
    request waited; each pool's labelled series looked up once a batch, not twice a placement."""
    counts: dict[str, int] = {}
    waits: dict[str, Any] = {}
    for pool_id, waited in placements:
        observe = waits.get(pool_id)
        if observe is None:
            observe = waits[pool_id] = WAITED.labels(pool_id).observe
            counts[pool_id] = 0
        counts[pool_id] += 1
        observe(max(0.0, waited))
    for pool_id, n in counts.items():
        PLACEMENTS.labels(pool_id).inc(n)


def record_cycle(report: Any) -> None:
    """A scheduler cycle's outcomes (a CycleReport)."""
    for outcome in ("rejected", "voided", "expired", "preempted", "conflicts"):
        n = getattr(report, outcome, 0)
        if n:
            CYCLE_OUTCOMES.labels(outcome).inc(n)


class _Forward(Collector):
    """PROCESS's metrics in a plane's registry (a registry's collectors are its own)."""

    def collect(self) -> Any:
        return PROCESS.collect()


def registry_for(*, log_head: Callable[[], int | None] | None = None,
                 database_url: str | None = None, schema: str = "") -> CollectorRegistry:
    """What a plane process serves: PROCESS, plus the views (read at scrape time, with the
    log's head for the lag) when it has a database, else the log's head alone."""
    from projections.metrics import views_or_head

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Forward())
    collector = views_or_head(database_url, schema, log_head=log_head)
    if collector is not None:
        registry.register(collector)
    return registry


class MetricsServer:
    """`registry` in the Prometheus text format on http://host:port/metrics, on a thread."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
        self.registry = registry
        self._server, self._thread = start_http_server(port, host, registry=registry)
        self.port = int(self._server.server_address[1])
        self.url = f"http://{host}:{self.port}/metrics"

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


__all__ = ["PROCESS", "MetricsServer", "placed_many", "record_cycle", "registry_for"]
