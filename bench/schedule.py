"""`pool bench schedule`: placements/s from accepted request to durable reservation, one run.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bus_rates import raw_atomic_rate
from bus.local.server import NatsServer
from domain.account import Account
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.pool import Pool, TenantPolicy
from domain.poolconfig import PoolConfig
from domain.prices import PriceList
from domain.resources import NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.scheduler import Scheduler, tune_gc
from workers.scheduler.planner import Planner

TENANTS = (("alpha", 3), ("beta", 2), ("gamma", 1))
# the figure's name wherever it is shown: it is not what a user's request sees (bench e2e is)
BACKLOG_LABEL = "placements/s, scheduler alone, log written beforehand"
SUBMIT_BATCH = 999  # leases per save: one event each (as the front door writes them)


def make_node(i: int, now: float) -> Node:
    zone = f"z{i % 3}"
    caps = NodeCapabilities(
        allocatable=Resources(cpu_millis=32000, memory_mib=131072, local_disk_gib=500),
        zone=zone, failure_domain=f"{zone}-r{i % 20}",
    )
    return Node.register(node_id=NodeId(f"n{i:05d}"), pool_id=PoolId("bench"),
                         capabilities=caps, now=now)


# `unplaceable` requests ask for more CPU than a bench node has; one node of twice the size,
# cordoned, could hold them, so they wait (are not rejected as fitting no node ever)
BIG_CPU_MILLIS = 48000


def _big_cordoned_node(i: int, now: float) -> Node:
    """A node that could hold an `unplaceable` request, cordoned so it holds none."""
    caps = NodeCapabilities(
        allocatable=Resources(cpu_millis=2 * 32000, memory_mib=131072, local_disk_gib=500),
        zone="z0", failure_domain="z0-big",
    )
    node = Node.register(node_id=NodeId(f"n{i:05d}"), pool_id=PoolId("bench"),
                         capabilities=caps, now=now)
    node.cordon(now, "bench: requests wait for it")
    return node


def _requests(shape: Shape, first: int, end: int) -> list[Lease]:
    out = []
    for i in range(first, end):
        lease = Lease.request(tenant_id=TenantId(TENANTS[i % 3][0]), pool_id=PoolId("bench"),
                              idempotency_key=f"r{i}", shape=shape,
                              maximum_runtime_seconds=3600, now=time.time(),
                              priority_class="standard", queued=True)
        out.append(lease)
    return out


def _produce_steady(url: str, first: int, count: int, per_second: float, out: Any) -> None:
    """In a process of its own: request `count` leases at `per_second`, one save every 0.1 s;
    puts {lease id: perf_counter at the save's ack} on `out` at the end."""
    app = PoolApp(env=app_env(url))
    shape = Shape.build(cpu_millis=1000, memory_mib=2048)
    step = max(1, int(per_second / 10))
    accepted: dict[str, float] = {}
    next_at = time.perf_counter()
    try:
        for start in range(first, first + count, step):
            next_at += step / per_second
            time.sleep(max(0.0, next_at - time.perf_counter()))
            batch = _requests(shape, start, min(first + count, start + step))
            app.save(*batch)
            t = time.perf_counter()
            for lease in batch:
                accepted[str(lease.id)] = t
    finally:
        out.put(accepted)
        app.close()


def run_schedule_bench(
    *, nodes: int = 10000, requests: int = 100000, quick: bool = False,
    rate: float = 1000.0, steady_seconds: float = 10.0, priced: bool = False,
    progress: Callable[[str], None] | None = None, half_life_seconds: int = 0,
    unplaceable: int = 0,
) -> dict[str, Any]:
    if quick:
        nodes, requests = min(nodes, 500), min(requests, 3000)
        rate, steady_seconds = min(rate, 500.0), min(steady_seconds, 3.0)
    budget = Planner().max_examined_per_cycle
    if not 0 <= unplaceable < budget:
        # a cycle examines the waiting ones first: as many as it examines, and the backlog
        # behind them would never be reached
        raise ValueError(f"unplaceable: 0 to {budget - 1} (a cycle examines {budget})")
    say = progress or (lambda _s: None)
    with tempfile.TemporaryDirectory(prefix="pool-bench-sched-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-sched").start()
        try:
            return _run(server.url, nodes, requests, rate, steady_seconds, say, priced=priced,
                        half_life_seconds=half_life_seconds, unplaceable=unplaceable)
        finally:
            from bus.runtime import close_runtime

            close_runtime(server.url)  # else the shared connection retries a stopped server
            server.stop()


def _run(url: str, nodes: int, requests: int, rate: float, steady_seconds: float,
         say: Callable[[str], None], *, priced: bool = False,
         half_life_seconds: int = 0, unplaceable: int = 0) -> dict[str, Any]:
    from bus.admin import ensure_all_streams

    ensure_all_streams(url)
    say("bench schedule: raw JetStream atomic-batch ingest (999 messages per batch)")
    raw = raw_atomic_rate(url)
    producer = PoolApp(env=app_env(url))
    now = time.time()
    cfg = PoolConfig(priority_classes=(("standard", 10),), default_priority_class="standard",
                     commit_timeout_seconds=3600,
                     fair_share_half_life_seconds=half_life_seconds)
    # priced: every placement also holds credits on its tenant's account (one more event)
    prices = PriceList(cpu_core_second=10, memory_gib_second=1) if priced else None
    producer.save(Pool.create(pool_id=PoolId("bench"), now=now, config=cfg, price_list=prices))
    setup: list[Any] = []
    for tenant, weight in TENANTS:
        setup.append(TenantPolicy.set(pool_id=PoolId("bench"), tenant_id=TenantId(tenant),
                                      now=now, weight=weight))
        acc = Account.open(tenant_id=TenantId(tenant), now=now)
        acc.grant("bench-grant", 10**15, now)
        setup.append(acc)
    producer.save(*setup)
    say(f"bench schedule: registering {nodes} nodes")
    for start in range(0, nodes, 999):
        producer.save(*[make_node(i, now) for i in range(start, min(nodes, start + 999))])
    if unplaceable:
        producer.save(_big_cordoned_node(nodes, now))

    sched_app = PoolApp(env=app_env(url))
    scheduler = Scheduler(sched_app)
    tune_gc()  # as `pool serve` does in a process that runs the scheduler
    reserved_at: dict[str, float] = {}
    written = [0]  # messages the scheduler's saves recorded
    real_save = sched_app.save

    def timed_save(*aggs: Any, **kw: Any) -> Any:
        out = real_save(*aggs, **kw)
        t = time.perf_counter()
        written[0] += len(out)
        for a in aggs:
            if isinstance(a, Lease) and a.state is LeaseState.RESERVED:
                reserved_at.setdefault(str(a.id), t)
        return out

    real_save_nowait = sched_app.save_nowait

    def timed_save_nowait(*aggs: Any) -> Any:
        # a placement is durable when the server acknowledges its batch: stamped then, on the
        # bus thread, not when the scheduler next looks (it is planning the next batch)
        pending = real_save_nowait(*aggs)
        leases = [str(a.id) for a in aggs
                  if isinstance(a, Lease) and a.state is LeaseState.RESERVED]

        def acked(ok: bool) -> None:
            if ok:
                t = time.perf_counter()
                written[0] += pending.messages
                for lid in leases:
                    reserved_at.setdefault(lid, t)

        pending.add_done_callback(acked)
        return pending

    sched_app.save = timed_save
    sched_app.save_nowait = timed_save_nowait
    t_replay = time.perf_counter()
    scheduler.catch_up()
    replay_s = time.perf_counter() - t_replay

    accepted_at: dict[str, float] = {}
    shape = Shape.build(cpu_millis=1000, memory_mib=2048)

    def produce(first: int = 0, count: int = requests) -> None:
        for start in range(first, first + count, SUBMIT_BATCH):
            batch = _requests(shape, start, min(first + count, start + SUBMIT_BATCH))
            producer.save(*batch)
            t = time.perf_counter()
            for lease in batch:
                accepted_at[str(lease.id)] = t

    gc.collect()
    steady = int(rate * steady_seconds)
    say(f"bench schedule: a steady {rate:,.0f} requests/s for {steady_seconds:g} s "
        "(producer in its own process)")
    # the producer runs in another process, so it neither shares the scheduler's GIL nor its
    # bus connection; perf_counter is CLOCK_MONOTONIC, comparable across processes on Linux
    ctx = multiprocessing.get_context("spawn")
    accepted_q: Any = ctx.Queue()
    proc = ctx.Process(target=_produce_steady, args=(url, 2 * requests, steady, rate, accepted_q),
                       daemon=True)
    proc.start()
    t0 = time.perf_counter()
    idle_since: float | None = None
    while True:
        report = scheduler.cycle()
        if len(reserved_at) >= steady:
            break
        if not proc.is_alive() and not report.placed:
            idle_since = idle_since or time.perf_counter()
            if time.perf_counter() - idle_since > 3:
                break
        else:
            idle_since = None
        if not report.placed:
            time.sleep(0.005)
    accepted_at.update(accepted_q.get(timeout=60))
    proc.join(10)
    elapsed = max(reserved_at.values(), default=t0) - t0
    latencies = sorted(reserved_at[k] - accepted_at[k] for k in reserved_at if k in accepted_at)
    steady_placed = len(reserved_at)

    # backlog: the same number again, all written to the log first, then the scheduler alone
    # is timed from reading them (its catch-up) to the last durable reservation
    say(f"bench schedule: a backlog of {requests} queued requests, scheduler timed alone")
    if unplaceable:
        # a deep queue: requests that wait for the cordoned node, every cycle, ahead of the
        # backlog (older, so each tenant's come first in its fair order)
        say(f"bench schedule: {unplaceable} requests that fit no node ahead of it")
        big = Shape.build(cpu_millis=BIG_CPU_MILLIS, memory_mib=2048)
        first = 3 * requests  # idempotency keys apart from the backlog's and the steady's
        for start in range(first, first + unplaceable, SUBMIT_BATCH):
            producer.save(*_requests(big, start, min(first + unplaceable, start + SUBMIT_BATCH)))
    produce(first=requests)
    reserved_at.clear()
    written[0] = 0
    t1 = time.perf_counter()
    cpu1 = time.process_time()  # every thread of this process: the producer is idle by now
    scheduler.catch_up()
    backlog_read_s = time.perf_counter() - t1
    while len(reserved_at) < requests:
        if not scheduler.cycle().placed:
            break
    backlog_s = max(reserved_at.values(), default=t1) - t1
    queue = scheduler.pools["bench"].queue
    waiting = len(queue) if queue is not None else 0  # the unplaceable, if they waited
    placed = len(reserved_at)
    # what the placements cost the scheduler's process, whatever else the machine runs: on a
    # shared machine the wall-clock rate swings with its load, this much less
    backlog_cpu_us = (time.process_time() - cpu1) * 1e6 / placed if placed else 0.0
    # the same without the catch-up: what the figure timed before its timer took the read in
    # (e4d3120 and earlier), so a baseline of that time compares like with like
    cycles_s = backlog_s - backlog_read_s
    cycles_rate = placed / cycles_s if cycles_s > 0 else 0.0
    backlog_rate = placed / backlog_s if backlog_s > 0 else 0.0
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steady_rate = steady_placed / elapsed if elapsed > 0 else 0.0
    # compare like with like: the messages the placements wrote (lease + node, + a credit hold
    # when the pool has prices) per second, against raw messages per second
    backlog_msgs = written[0] / backlog_s if backlog_s > 0 else 0.0
    ratio = backlog_msgs / raw if raw else 0.0

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else 0.0

    producer.close()
    sched_app.close()
    lines = [
        f"{'figure':54} {'value':>12}",
        "-" * 68,
        f"{'nodes':54} {nodes:12,}",
        f"{'pool prices (each placement holds credits)':54} {'yes' if priced else 'none':>12}",
        f"{'fair-share half-life (s; 0: current usage only)':54} {half_life_seconds:12,}",
        f"{'requests':54} {requests:12,}",
        f"{'  queued ahead of the backlog, fitting no node':54} {unplaceable:12,}",
        f"{'  still waiting when the backlog was placed':54} {waiting:12,}",
        f"{'backlog requests placed':54} {placed:12,}",
        f"{BACKLOG_LABEL:54} {backlog_rate:12,.0f}",
        f"{'  of which reading the backlog from the log (s)':54} {backlog_read_s:12.3f}",
        f"{'  process CPU per backlog placement (µs)':54} {backlog_cpu_us:12,.0f}",
        f"{'  placements/s, the read from the log not timed':54} {cycles_rate:12,.0f}",
        f"{'steady offered load (requests/s)':54} {rate:12,.0f}",
        f"{'  placed of them':54} {steady_placed:12,}",
        f"{'  latency p50, accepted → durably reserved (s)':54} {pct(0.50):12.3f}",
        f"{'  latency p99 (s)':54} {pct(0.99):12.3f}",
        f"{'scheduler replay of the setup log (s)':54} {replay_s:12.3f}",
        f"{'process max RSS (MiB, producer + scheduler)':54} {rss_mib:12,.0f}",
        f"{'raw atomic-batch ingest (msgs/s)':54} {raw:12,.0f}",
        f"{'backlog messages written/s (events of placements)':54} {backlog_msgs:12,.0f}",
        f"{'backlog placement messages/s ÷ raw ingest':54} {ratio:12.2f}",
        f"machine: {os.cpu_count()} cores; nats-server 2.15 file storage, sync_interval always",
    ]
    return {"nodes": nodes, "requests": requests, "placed": placed, "priced": priced,
            "half_life_seconds": half_life_seconds, "unplaceable": unplaceable,
            "waiting_at_end": waiting,
            "steady_rate": rate, "steady_placed": steady_placed,
            "steady_placements_per_s": steady_rate, "backlog_placements_per_s": backlog_rate,
            "latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99), "rss_mib": rss_mib,
            "raw_atomic_msgs_per_s": raw, "ratio_to_raw": ratio,
            "backlog_msgs_per_s": backlog_msgs, "replay_s": replay_s,
            "backlog_s": backlog_s, "backlog_read_s": backlog_read_s,
            "backlog_cpu_us_per_placement": backlog_cpu_us,
            "backlog_placements_per_s_read_untimed": cycles_rate,
            "table": "\n".join(lines)}
