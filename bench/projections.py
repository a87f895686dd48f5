"""`pool bench projections`: the PostgreSQL views and the credit audit against one fresh log.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import bisect
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bus_rates import raw_atomic_rate
from bus.local.server import NatsServer
from bus.recorders import log_recorder
from domain.account import Account
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.pool import Pool
from domain.poolconfig import PoolConfig
from domain.resources import LeaseId, NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId

SAVE_LIMIT = 999  # events per save: one atomic batch, under the 1000-message limit
POOL = "benchp"
GOALS = {"applied_per_s": 20_000, "lag_p99_s": 0.250, "rebuild_1m_s": 60.0,
         "audit_per_s": 100_000, "as_of_s": 2.0}
FULL = {"events": 200_000, "rate": 5000, "seconds": 10.0, "tenants": 200, "nodes": 50}
QUICK = {"events": 5000, "rate": 1000, "seconds": 3.0, "tenants": 40, "nodes": 10}


class Workload:
    """Makes batches of events for one save: credit movements on many accounts (about 88%),
    lease requests + queueings and cancels, node heartbeats."""

    def __init__(self, tenants: int, nodes: int, *, prefix: str = "") -> None:
        now = time.time()
        self.pool = Pool.create(pool_id=PoolId(POOL), now=now,
                                config=PoolConfig(priority_classes=(("standard", 10),),
                                                  default_priority_class="standard"))
        self.accounts: list[Account] = []
        for t in range(tenants):
            acc = Account.open(tenant_id=TenantId(f"{prefix}t{t:04d}"), now=now)
            acc.grant(f"g{t}", 10**15, now)
            self.accounts.append(acc)
        self.nodes = [
            Node.register(node_id=NodeId(f"{prefix}pn{i:04d}"), pool_id=PoolId(POOL), now=now,
                          capabilities=NodeCapabilities(
                              allocatable=Resources(cpu_millis=64000, memory_mib=262144),
                              zone=f"z{i % 3}", failure_domain=f"z{i % 3}-r{i % 10}"))
            for i in range(nodes)
        ]
        self.shape = Shape.build(cpu_millis=1000, memory_mib=1024)
        self.queued: list[Lease] = []
        self.open_holds: list[dict[str, None]] = [{} for _ in self.accounts]
        self.n_leases = 0
        self.n_transfers = 0
        self.cursor = 0
        self.credit_events = tenants  # the grants above
        self.setup_events = 1 + 2 * tenants + nodes

    def setup(self) -> list[Any]:
        return [self.pool, *self.accounts, *self.nodes]

    def batch(self, n: int) -> tuple[list[Any], int]:
        """Aggregates carrying exactly min(n, SAVE_LIMIT) new events (n ≥ 1)."""
        n = max(1, min(n, SAVE_LIMIT))
        now = time.time()
        touched: dict[int, Any] = {}
        left = n
        # lease events, ~8%: a request + queue (2 events) per new lease; cancel an older one
        for _ in range(n // 25):
            if left < 3:
                break
            t = self.n_leases % len(self.accounts)
            lease = Lease.request(tenant_id=self.accounts[t].tenant_id, pool_id=PoolId(POOL),
                                  idempotency_key=f"k{self.n_leases}", shape=self.shape,
                                  maximum_runtime_seconds=3600, now=now,
                                  priority_class="standard")
            lease.queue(now)
            self.n_leases += 1
            touched[id(lease)] = lease
            left -= 2
            # a hold for the lease itself, so leases rows carry both state and credits
            self._hold(t, str(lease.id), now, touched)
            left -= 1
            self.queued.append(lease)
            if len(self.queued) > 200 and left >= 1:
                old = self.queued.pop(0)
                if old.state is LeaseState.QUEUED and old.cancel(now):
                    touched[id(old)] = old
                    left -= 1
        # node heartbeats, ~1%
        for _ in range(min(n // 100, left)):
            node = self.nodes[self.cursor % len(self.nodes)]
            node.heartbeat(now)
            touched[id(node)] = node
            left -= 1
            self.cursor += 1
        # credit movements on the accounts, round robin: settle / release an open hold, or hold
        while left > 0:
            t = self.cursor % len(self.accounts)
            self.cursor += 1
            holds = self.open_holds[t]
            acc = self.accounts[t]
            if holds:
                lid = next(iter(holds))
                del holds[lid]
                self.n_transfers += 1
                if self.n_transfers % 4:
                    # nothing ran on the bench's leases, so the audit expects a charge of 0
                    acc.settle(f"x{self.n_transfers}", LeaseId(lid), 0, now)
                else:
                    acc.release_hold(f"x{self.n_transfers}", LeaseId(lid), now)
                self.credit_events += 1
            else:
                self._hold(t, str(uuid.uuid4()), now, touched)
            touched[id(acc)] = acc
            left -= 1
        return list(touched.values()), n

    def _hold(self, t: int, lease_id: str, now: float, touched: dict[int, Any]) -> None:
        acc = self.accounts[t]
        self.n_transfers += 1
        acc.hold(f"x{self.n_transfers}", LeaseId(lease_id), 1000 + self.n_transfers % 997, now)
        self.open_holds[t][lease_id] = None
        self.credit_events += 1
        touched[id(acc)] = acc


def _produce_at_rate(url: str, tenants: int, nodes: int, rate: int, duration: float,
                     out: Any) -> None:
    """In a process of its own: a workload on accounts and nodes of its own ("lag-" ids),
    appended at `rate` events/s for `duration` s, one save per 50 ms tick; puts the saves'
    (first id, last id, perf_counter at the ack), the events written and the span on `out`."""
    from workers.application import PoolApp
    from workers.bootstrap import app_env

    app = PoolApp(env=app_env(url))
    work = Workload(tenants, nodes, prefix="lag-")
    setup = work.setup()[1:]  # the pool exists already
    for i in range(0, len(setup), SAVE_LIMIT):
        app.save(*setup[i:i + SAVE_LIMIT])
    saves: list[tuple[int, int, float]] = []
    written = 0
    tick = 0.05
    t0 = time.perf_counter()
    try:
        while True:
            now = time.perf_counter()
            if now - t0 >= duration:
                break
            due = int(rate * (now - t0)) - written
            if due <= 0:
                time.sleep(min(tick, duration - (now - t0)))
                continue
            aggs, n = work.batch(due)
            recs = app.save(*aggs)
            saves.append((recs[0].notification.id, recs[-1].notification.id,
                          time.perf_counter()))
            written += n
        span = time.perf_counter() - t0
    finally:
        app.close()
    out.put({"saves": saves, "written": written, "span": span,
             "credit_events": work.credit_events})


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


def run_projections_bench(
    *, database_url: str | None = None, events: int | None = None, quick: bool = False,
    rate: int | None = None, seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    size = dict(QUICK if quick else FULL)
    if events is not None:
        size["events"] = events
    if rate is not None:
        size["rate"] = rate
    if seconds is not None:
        size["seconds"] = seconds
    say = progress or (lambda _s: None)
    with tempfile.TemporaryDirectory(prefix="pool-bench-proj-") as tmp:
        pg = None
        if not database_url:
            from projections.postgres.embedded import start_embedded_postgres

            say("bench projections: starting an embedded PostgreSQL")
            pg = start_embedded_postgres(Path(tmp) / "pg")
            database_url = pg.url
        server = NatsServer(store_dir=Path(tmp) / "nats", server_name="pool-bench-proj").start()
        schema = f"bench_proj_{uuid.uuid4().hex[:10]}"
        try:
            return _run(server.url, database_url, schema, size, say)
        finally:
            from bus.runtime import close_runtime
            from projections.views import drop_schema

            close_runtime(server.url)
            server.stop()
            try:
                drop_schema(database_url, schema)
            finally:
                if pg is not None:
                    pg.stop()


def _run(url: str, db: str, schema: str, size: dict[str, Any],
         say: Callable[[str], None]) -> dict[str, Any]:
    from bus.admin import ensure_all_streams
    from projections.audit import audit_credits
    from projections.views import VIEWS, positions_at, read_pages, rebuild
    from workers.application import PoolApp
    from workers.bootstrap import app_env, application
    from workers.projector import CATCH_UP_FACTOR, Projector

    ensure_all_streams(url)
    say("bench projections: raw JetStream atomic-batch ingest (999 messages per batch)")
    raw = raw_atomic_rate(url)

    producer = PoolApp(env=app_env(url))
    work = Workload(size["tenants"], size["nodes"])
    producer.save(*work.setup())
    target = int(size["events"])
    say(f"bench projections: writing {target:,} events")
    written = work.setup_events
    t0 = time.perf_counter()
    while written < target:
        aggs, n = work.batch(target - written)
        producer.save(*aggs)
        written += n
    write_s = time.perf_counter() - t0
    # the pre-writer's state (its aggregates: every transfer id of every account, the recorder's
    # memory of each subject) would stay in the projector's process, which a real projector has
    # not, and lengthen its garbage-collector passes: keep the counts, start a fresh app
    setup_events, credit_events = work.setup_events, work.credit_events
    del work
    aggs = []
    producer.close()
    producer = PoolApp(env=app_env(url))
    top = producer.recorder.max_notification_id() or 0

    # 1. catch-up: the real projector, all four views together, from an empty schema
    say(f"bench projections: projector catching up on {top:,} events")
    proj = Projector(application(url), db, schema=schema, batch_size=1000)
    commits: list[tuple[int, float]] = []
    real_process = proj.views.process

    def timed_process(batch: Any, **kw: Any) -> int:
        out = real_process(batch, **kw)  # returns after the batch's transaction committed
        commits.append((batch[-1].id, time.perf_counter()))
        return out

    proj.views.process = timed_process  # type: ignore[method-assign,assignment]
    t1 = time.perf_counter()
    proj.start()
    caught_up = proj.wait_until(top, timeout=max(120.0, top / 500))
    catchup_s = time.perf_counter() - t1
    applied_rate = top / catchup_s if caught_up and catchup_s > 0 else 0.0

    # 2. lag at a steady rate, the projector running
    want_rate, duration = int(size["rate"]), float(size["seconds"])
    say(f"bench projections: lag while appending {want_rate:,} events/s for {duration:g} s")
    # the producer runs in a process of its own (as a real writer would), so it shares neither
    # the projector's GIL nor its bus connection; perf_counter is CLOCK_MONOTONIC on Linux,
    # comparable across processes
    ctx = multiprocessing.get_context("spawn")
    lag_q: Any = ctx.Queue()
    lag_proc = ctx.Process(target=_produce_at_rate, args=(
        url, int(size["tenants"]), int(size["nodes"]), want_rate, duration, lag_q), daemon=True)
    lag_proc.start()
    got = lag_q.get(timeout=duration + 300)
    lag_proc.join(30)
    saves: list[tuple[int, int, float]] = got["saves"]  # first id, last id, ack time
    lag_written, lag_span = got["written"], got["span"]
    credit_events += got["credit_events"]
    achieved = lag_written / lag_span if lag_span > 0 else 0.0
    top = producer.recorder.max_notification_id() or 0
    proj.wait_until(top, timeout=120)
    proj.stop()
    commit_ids = [c[0] for c in commits]
    lags: list[float] = []
    for first, last, acked in saves:
        for nid in range(first, last + 1):
            i = bisect.bisect_left(commit_ids, nid)
            if i < len(commits):
                lags.append(max(0.0, commits[i][1] - acked))
    lags.sort()

    # 2b. the views as they were: a page at points across the log's span, on the views just built
    from bench.asof import time_as_of

    say("bench projections: the views as they were (--at), at points across the log")
    asof = time_as_of(db, schema)

    # 3. rebuild of the balance view from the first event
    say(f"bench projections: rebuilding the balance view from event 1 ({top:,} events)")
    t3 = time.perf_counter()
    rebuild(producer, db, schema=schema, views=["balance"], batch_size=1000)
    rebuild_s = time.perf_counter() - t3
    rebuild_1m_s = rebuild_s * 1_000_000 / top if top else 0.0
    pos = positions_at(db, schema)
    view_positions = {v: pos.get(v, (0, 0))[0] for v in VIEWS}

    # for reading the figures: the log read alone, and read + decoded, without any folding
    t5 = time.perf_counter()
    start = 1
    while start <= top:
        got = producer.recorder.select_notifications(start, 1000, stop=top)
        if not got:
            break
        start = got[-1].id + 1
    read_s = time.perf_counter() - t5
    t5 = time.perf_counter()
    start = 1
    while start <= top:
        got = producer.recorder.select_notifications(start, 1000, stop=top)
        if not got:
            break
        for note in got:
            producer.mapper.to_domain_event(note)
        start = got[-1].id + 1
    decode_s = time.perf_counter() - t5
    read_rate = top / read_s if read_s else 0.0
    decode_rate = top / decode_s if decode_s else 0.0
    # the projector's, the rebuild's and the audit's way: pages read ahead (bus.jetstream's
    # prefetch, a pull consumer)
    t5 = time.perf_counter()
    for _page in read_pages(log_recorder(producer.recorder), 1, 1000, stop=top):
        pass
    ahead_s = time.perf_counter() - t5
    ahead_rate = top / ahead_s if ahead_s else 0.0

    # 4. the credit audit replaying the log (and cross-checking the rebuilt balance view)
    say("bench projections: credit audit replaying the log")
    t4 = time.perf_counter()
    report = audit_credits(producer, database_url=db, schema=schema)
    audit_s = time.perf_counter() - t4
    audit_rate = credit_events / audit_s if audit_s > 0 else 0.0
    producer.close()

    ratio = applied_rate / raw if raw else 0.0
    p50, p99 = _pct(lags, 0.50), _pct(lags, 0.99)
    measured_1m = top >= 1_000_000
    rate_note = ("" if achieved >= 0.95 * want_rate
                 else f"  (asked {want_rate:,}/s: the producer could not sustain it)")

    def ok(good: bool) -> str:
        return "met" if good else "MISSED"

    w = 50
    lines = [
        f"{'figure':{w}} {'value':>12}  {'goal':>12}",
        "-" * (w + 28),
        f"{'events in the log (max notification id)':{w}} {top:12,}",
        f"{'  of which credit events (grant/hold/settle/release)':{w}} {credit_events:12,}",
        (f"{'producer write rate, pre-written log (events/s)':{w}} "
         f"{(written - setup_events) / write_s if write_s else 0:12,.0f}"),
        (f"{'applied events/s, catch-up, all 4 views together':{w}} {applied_rate:12,.0f}  "
         f"{'≥ 20,000':>12} {ok(applied_rate >= GOALS['applied_per_s'])}"),
        f"{'  (projector as a whole: one txn per batch of 1000,':{w}}",
        f"{f'   up to {1000 * CATCH_UP_FACTOR} while behind)':{w}}",
        f"{'producer rate during the lag run (events/s)':{w}} {achieved:12,.0f}{rate_note}",
        f"{'lag p50, append ack → covering commit (s)':{w}} {p50:12.3f}",
        f"{'lag p99 (s)':{w}} {p99:12.3f}  {'≤ 0.250':>12} {ok(p99 <= GOALS['lag_p99_s'])}",
        f"{'  (projector wakes on appends, reads ahead)':{w}}",
        f"{f'rebuild balance view, {top:,} events (s)':{w}} {rebuild_s:12.2f}",
        (f"{'rebuild of 1,000,000 events (s)' + ('' if measured_1m else ', EXTRAPOLATED'):{w}} "
         f"{rebuild_1m_s:12.1f}  {'≤ 60':>12} {ok(rebuild_1m_s <= GOALS['rebuild_1m_s'])}"),
        (f"{'a view as it was (--at), slowest page (s)':{w}} {asof['slowest_s']:12.3f}  "
         f"{'≤ 2':>12} {ok(asof['slowest_s'] <= GOALS['as_of_s'])}"),
        f"{'  row versions kept for --at':{w}} {asof.get('history_versions', 0):12,}",
        *(f"  {view} at 5/25/50/75/95 % of the log's span (s): " + " ".join(
            f"{p['median_s']:.3f}" for p in asof["points"] if p["view"] == view)
          for view in dict.fromkeys(p["view"] for p in asof["points"])),
        (f"{'audit replay, credit events/s':{w}} {audit_rate:12,.0f}  {'≥ 100,000':>12} "
         f"{ok(audit_rate >= GOALS['audit_per_s'])}"),
        f"{'  audit replay, all events/s':{w}} {top / audit_s if audit_s else 0:12,.0f}",
        f"{'  audit result':{w}} {'ok' if report.ok else 'FAILED':>12}",
        f"{'log read alone, select_notifications (events/s)':{w}} {read_rate:12,.0f}",
        f"{'log read alone, read-ahead pages (events/s)':{w}} {ahead_rate:12,.0f}",
        f"{'log read + decode to domain events (events/s)':{w}} {decode_rate:12,.0f}",
        f"{'raw atomic-batch ingest, 999 msgs (msgs/s)':{w}} {raw:12,.0f}",
        f"{'applied events/s ÷ raw ingest':{w}} {ratio:12.2f}",
        "view positions: " + ", ".join(f"{v} {p:,}" for v, p in view_positions.items()),
        (f"machine: {os.cpu_count()} cores; nats-server file storage; "
         f"PostgreSQL {db.split('@')[-1]}"),
    ]
    if not measured_1m:
        lines.append("rebuild of 1M is extrapolated linearly from the measured rebuild above")
    return {
        "events": top, "credit_events": credit_events, "caught_up": caught_up,
        "write_events_per_s": (written - setup_events) / write_s if write_s else 0.0,
        "applied_events_per_s": applied_rate, "applied_scope": "projector (all 4 views together)",
        "catchup_s": catchup_s,
        "lag_rate_asked": want_rate, "lag_rate_achieved": achieved, "lag_seconds": duration,
        "lag_samples": len(lags), "lag_p50_s": p50, "lag_p99_s": p99,
        "rebuild_balance_s": rebuild_s, "rebuild_1m_s": rebuild_1m_s,
        "rebuild_1m_extrapolated": not measured_1m, "as_of": asof,
        "audit_s": audit_s, "audit_credit_events_per_s": audit_rate, "audit_ok": report.ok,
        "audit_discrepancies": len(report.discrepancies), "audit_position": report.position,
        "log_read_events_per_s": read_rate, "log_read_decode_events_per_s": decode_rate,
        "log_read_ahead_events_per_s": ahead_rate,
        "raw_atomic_msgs_per_s": raw, "ratio_to_raw": ratio,
        "view_positions": view_positions, "max_notification_id": top, "goals": GOALS,
        "schema": schema,
        "table": "\n".join(lines),
    }
