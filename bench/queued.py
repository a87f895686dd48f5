"""`pool bench queued`: a scheduler starting over a deep queue: its replay time and memory.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bus.local.server import NatsServer

SUBMIT_BATCH = 999  # leases per save: one event each (requested and queued), under the limit
SHAPES = ((1000, 2048), (2000, 4096), (4000, 8192), (500, 1024))


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB, from /proc (Linux)."""
    now = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                now = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return now, peak


def write_log(url: str, nodes: int, requests: int, say: Callable[[str], None]) -> float:
    """Pool, tenants, nodes and `requests` queued leases; seconds spent writing requests."""
    from bench.schedule import TENANTS, make_node
    from domain.account import Account
    from domain.lease import Lease
    from domain.pool import Pool, TenantPolicy
    from domain.poolconfig import PoolConfig
    from domain.resources import PoolId, Shape, TenantId
    from workers.application import PoolApp
    from workers.bootstrap import app_env

    app = PoolApp(env=app_env(url))
    now = time.time()
    cfg = PoolConfig(priority_classes=(("standard", 10),), default_priority_class="standard",
                     commit_timeout_seconds=3600)
    app.save(Pool.create(pool_id=PoolId("bench"), now=now, config=cfg))
    setup: list[Any] = []
    for tenant, weight in TENANTS:
        setup.append(TenantPolicy.set(pool_id=PoolId("bench"), tenant_id=TenantId(tenant),
                                      now=now, weight=weight))
        acc = Account.open(tenant_id=TenantId(tenant), now=now)
        acc.grant("bench-grant", 10**15, now)
        setup.append(acc)
    app.save(*setup)
    for start in range(0, nodes, 999):
        app.save(*[make_node(i, now) for i in range(start, min(nodes, start + 999))])
    shapes = [Shape.build(cpu_millis=c, memory_mib=m) for c, m in SHAPES]
    t0 = time.perf_counter()
    for start in range(0, requests, SUBMIT_BATCH):
        batch = []
        for i in range(start, min(requests, start + SUBMIT_BATCH)):
            key = f"q{i}"
            lease = Lease.request(
                tenant_id=TenantId(TENANTS[i % 3][0]), pool_id=PoolId("bench"),
                idempotency_key=key, shape=shapes[i % len(shapes)],
                maximum_runtime_seconds=3600, now=now, priority_class="standard",
                trace_parent=f"00-{i:032x}-{i:016x}-01",
                request_digest=hashlib.sha256(key.encode()).hexdigest(), queued=True)
            batch.append(lease)
        app.save(*batch)
        if start and start % 100_000 < SUBMIT_BATCH:
            say(f"bench queued: {start:,} requests written")
    written = time.perf_counter() - t0
    app.close()
    return written


def _start_scheduler(url: str, out: Any, key: bytes | None = None, write: bool = False) -> None:
    """In a process of its own: a fresh scheduler replays the log (from the checkpoint when
    `key` is given and not `write`), then runs one cycle; with `write`, it checkpoints its
    fold after the replay, before the cycle."""
    from bus.checkpoints import CheckpointStore
    from workers.application import PoolApp
    from workers.bootstrap import app_env
    from workers.scheduler import Scheduler, tune_gc
    from workers.scheduler.checkpoint import Checkpointer

    tune_gc()  # as `pool serve` does in a process that runs the scheduler
    app = PoolApp(env=app_env(url))
    scheduler = Scheduler(app)
    checkpoints = None
    if key is not None:
        checkpoints = Checkpointer(CheckpointStore(url), key)
        if write:
            checkpoints.tried = True  # the full replay: nothing is read
        scheduler.checkpoints = checkpoints
    base, _ = rss_mib()  # the code loaded, nothing read yet
    t0, c0 = time.perf_counter(), time.process_time()
    events = scheduler.catch_up()
    replay_s = time.perf_counter() - t0
    replay_cpu_s = time.process_time() - c0  # this process's CPU: less hostage to a busy box
    after_replay, _ = rss_mib()
    written: dict[str, Any] = {}
    if checkpoints is not None and write:
        w0 = time.perf_counter()
        assert checkpoints.write_now(scheduler)
        written = {"checkpoint_write_s": time.perf_counter() - w0,
                   "checkpoint_pause_s": checkpoints.last_pause_seconds,
                   "checkpoint_bytes": checkpoints.last_bytes}
    elif checkpoints is not None:
        written = {"restored_at": checkpoints.restored_at}
    t1 = time.perf_counter()
    report = scheduler.cycle()
    cycle_s = time.perf_counter() - t1
    after_cycle, peak = rss_mib()
    memory: Any = scheduler.aggregates
    queued = sum(len(ps.queue or ()) for ps in scheduler.pools.values())
    out.put({"events": events, "replay_s": replay_s, "replay_cpu_s": replay_cpu_s,
             "rss_base_mib": base,
             "rss_after_replay_mib": after_replay, "rss_after_cycle_mib": after_cycle,
             "rss_peak_mib": peak, "cycle_s": cycle_s, "placed_first_cycle": report.placed,
             "queued": queued, "held_compactly": len(getattr(memory, "queued", ())),
             "held_whole": len(getattr(memory, "full", memory)), **written})
    scheduler.close()
    app.close()


def in_process(url: str, key: bytes | None = None, write: bool = False) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out: Any = ctx.Queue()
    proc = ctx.Process(target=_start_scheduler, args=(url, out, key, write), daemon=True)
    proc.start()
    result: dict[str, Any] = out.get(timeout=3600)
    proc.join(60)
    return result


def _write_tail(url: str, requests: int, tail: int) -> None:
    """`tail` more queued requests after the checkpoint: what a restored start-up folds."""
    from bench.schedule import TENANTS
    from domain.lease import Lease
    from domain.resources import PoolId, Shape, TenantId
    from workers.application import PoolApp
    from workers.bootstrap import app_env

    app = PoolApp(env=app_env(url))
    now = time.time()
    shapes = [Shape.build(cpu_millis=c, memory_mib=m) for c, m in SHAPES]
    for start in range(requests, requests + tail, SUBMIT_BATCH):
        app.save(*[Lease.request(
            tenant_id=TenantId(TENANTS[i % 3][0]), pool_id=PoolId("bench"),
            idempotency_key=f"q{i}", shape=shapes[i % len(shapes)],
            maximum_runtime_seconds=3600, now=now, priority_class="standard",
            request_digest=hashlib.sha256(f"q{i}".encode()).hexdigest(), queued=True)
            for i in range(start, min(requests + tail, start + SUBMIT_BATCH))])
    app.close()


def run_queued_bench(*, nodes: int = 10_000, requests: int = 1_000_000, quick: bool = False,
                     progress: Callable[[str], None] | None = None,
                     checkpoint: bool = False) -> dict[str, Any]:
    if quick:
        nodes, requests = min(nodes, 500), min(requests, 20_000)
    say = progress or (lambda _s: None)
    with tempfile.TemporaryDirectory(prefix="pool-bench-queued-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-queued").start()
        try:
            from bus.admin import ensure_all_streams

            ensure_all_streams(server.url)
            say(f"bench queued: writing {nodes:,} nodes and {requests:,} queued requests")
            write_s = write_log(server.url, nodes, requests, say)
            from bus.runtime import close_runtime

            close_runtime(server.url)
            say("bench queued: a fresh scheduler process replays the log")
            key = os.urandom(32) if checkpoint else None
            result = in_process(server.url, key, write=checkpoint)
            restored: dict[str, Any] = {}
            if checkpoint:
                tail = max(1, requests // 100)
                say(f"bench queued: {tail:,} more requests, then a fresh scheduler process "
                    "starts from the checkpoint")
                _write_tail(server.url, requests, tail)
                close_runtime(server.url)
                restored = in_process(server.url, key)
                restored["tail"] = tail
        finally:
            server.stop()
    result.update(nodes=nodes, requests=requests, write_s=write_s)
    if restored:
        result["from_checkpoint"] = restored
    mib_per_request = (result["rss_after_replay_mib"] - result["rss_base_mib"]) / max(1, requests)
    result["kib_per_queued_request"] = mib_per_request * 1024
    lines = [
        f"{'figure':52} {'value':>12}",
        "-" * 66,
        f"{'nodes':52} {nodes:12,}",
        f"{'queued requests in the log':52} {requests:12,}",
        f"{'events replayed':52} {result['events']:12,}",
        f"{'start-up replay, fresh scheduler process (s)':52} {result['replay_s']:12.1f}",
        f"{'  its CPU time in the scheduler process (s)':52} {result['replay_cpu_s']:12.1f}",
        f"{'scheduler RSS after the replay (MiB)':52} {result['rss_after_replay_mib']:12,.0f}",
        f"{'scheduler RSS after its first cycle (MiB)':52} {result['rss_after_cycle_mib']:12,.0f}",
        f"{'scheduler peak RSS (MiB)':52} {result['rss_peak_mib']:12,.0f}",
        f"{'  of which per queued request (KiB)':52} {result['kib_per_queued_request']:12.2f}",
        f"{'placed by its first cycle':52} {result['placed_first_cycle']:12,}",
        f"{'  that cycle (s)':52} {result['cycle_s']:12.2f}",
        f"{'leases held compactly after it':52} {result['held_compactly']:12,}",
        f"{'aggregates held whole after it':52} {result['held_whole']:12,}",
        f"{'writing the requests beforehand (s, not the figure)':52} {write_s:12.1f}",
        f"machine: {os.cpu_count()} cores; nats-server 2.15 file storage, sync_interval always",
    ]
    if restored:
        ratio = restored["replay_s"] / max(result["replay_s"], 1e-9)
        rows = [
            ("checkpoint after the replay: lock held (s)",
             f"{result['checkpoint_pause_s']:12.1f}"),
            ("  stored, compressed (MiB)", f"{result['checkpoint_bytes'] / 2**20:12,.0f}"),
            ("  taken and stored (s)", f"{result['checkpoint_write_s']:12.1f}"),
            ("requests written after the checkpoint", f"{restored['tail']:12,}"),
            ("start-up from the checkpoint, fresh process (s)", f"{restored['replay_s']:12.1f}"),
            ("  its CPU time in the scheduler process (s)", f"{restored['replay_cpu_s']:12.1f}"),
            ("  events folded after the checkpoint", f"{restored['events']:12,}"),
            ("  scheduler RSS after it (MiB)", f"{restored['rss_after_replay_mib']:12,.0f}"),
            ("  placed by its first cycle", f"{restored['placed_first_cycle']:12,}"),
            ("start-up from the checkpoint / full replay", f"{ratio:12.2f}"),
        ]
        lines[-1:-1] = [f"{name:52} {value}" for name, value in rows]
    result["table"] = "\n".join(lines)
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m bench.queued",
        description="A fresh scheduler over a deep queue: start-up replay time and RSS.")
    parser.add_argument("--requests", type=int, default=1_000_000,
                        help="queued requests written beforehand (default 1,000,000)")
    parser.add_argument("--nodes", type=int, default=10_000, help="nodes (default 10,000)")
    parser.add_argument("--quick", action="store_true", help="500 nodes, 20,000 requests")
    parser.add_argument("--checkpoint", action="store_true",
                        help="also checkpoint the replayed fold, write 1%% more requests and "
                        "time a fresh scheduler starting from the checkpoint")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.nodes < 1:
        print("error: --requests and --nodes must be at least 1", file=sys.stderr)
        return 2
    result = run_queued_bench(nodes=args.nodes, requests=args.requests, quick=args.quick,
                              progress=lambda s: print(s, file=sys.stderr),
                              checkpoint=args.checkpoint)
    print(json.dumps(result, indent=2) if args.json else result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
