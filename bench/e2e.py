"""`pool bench e2e`: what a user sees, measured from outside the control plane in one run.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.children import await_ready, end_children
from bench.e2e_report import GOAL_ACCEPTED, GOAL_RESERVED, rows, table

__all__ = ["GOAL_ACCEPTED", "GOAL_RESERVED", "rows", "run_e2e_bench", "table"]
from bench.latency import Record, ms, pct, stages
from bench.machine import machine_line

POOL = "bench"
TENANTS = ["t0", "t1", "t2", "t3"]
SHAPE = {"cpu_millis": 100, "memory_mib": 64}  # small: the fleet holds every request of a run
CTX = multiprocessing.get_context("spawn")  # the parent holds threads: no fork
# the bench's pools: no reservation voided, no node lost over a run, and each tenant's lease
# requests past the pool's default rate (200/s each, burst 1,000: four tenants would cap the
# saturating phase near 1,200/s and refuse part of the 1,000/s one); the front door's
# capacity is measured, not one tenant's fair share (as the plane's POOL_TENANT_… below)
POOL_SETTINGS = {"commit_timeout_seconds": 3600, "node_timeout_seconds": 600,
                 "requests_per_second": 1_000_000, "request_burst": 1_000_000}


def serve_plane(url: str, ready: Any, stop: Any, roles: list[str] | None = None) -> None:
    """In a process of its own: every control-plane role (no views), or only `roles` (the
    scheduler's roles apart, as `pool up` runs them; more command responders)."""
    import os

    from workers.plane import ControlPlane

    # the front door's capacity, not one tenant's fair share: four tenants send it all, each
    # past the per-tenant command rate a plane gives a tenant by default (ADR 022)
    os.environ.setdefault("POOL_TENANT_COMMANDS_PER_SECOND", "1000000")
    plane = ControlPlane(url, database_url=None, roles=roles).start()
    ready.put("plane")
    stop.wait()
    plane.stop()


def pool_names(pools: int) -> list[str]:
    """The run's pools: POOL alone, or POOL-0 … POOL-(n-1)."""
    return [POOL] if pools == 1 else [f"{POOL}-{i}" for i in range(pools)]


def run_fleet(url: str, nodes: int, heartbeat_seconds: float, ready: Any, stop: Any,
               pools: list[str] | None = None) -> None:
    """In a process of its own: `nodes` simulated agents dealt over `pools`, registered, then
    beating."""
    from agents.simulate import fleet, start_fleets

    pools = pools or [POOL]
    sims = []
    for k, pool in enumerate(pools):
        mine = nodes // len(pools) + (1 if k < nodes % len(pools) else 0)
        prefix = "sim" if len(pools) == 1 else f"sim{k}"
        # a connection holds a share of the nodes: one holding all would pass the server's
        # subscriptions per connection and be cut off while enrolling
        sims.extend(start_fleets(url, fleet(mine, "cpu", prefix=prefix), pool_id=pool,
                                 heartbeat_interval=heartbeat_seconds))
    ready.put("fleet")
    stop.wait()
    for sim in sims:
        sim.stop()


class _Body:
    """Request i's body: a fresh idempotency key per request, the pools in turn (picklable
    for spawn)."""

    def __init__(self, prefix: str, count: int = 1, pools: tuple[str, ...] = (POOL,)) -> None:
        self.prefix = prefix
        self.count = count
        self.pools = pools

    def __call__(self, i: int) -> bytes:
        body: dict[str, Any] = {"pool_id": self.pools[i % len(self.pools)], "shape": SHAPE,
                                "maximum_runtime_seconds": 3600,
                                "idempotency_key": f"{self.prefix}-{i}"}
        if self.count > 1:
            body["count"] = self.count
        return json.dumps(body).encode()


def _client_process(url: str, clients: int, seconds: float, rate: float | None,
                    prefix: str, count: int, pools: tuple[str, ...], out: Any) -> None:
    from bench.loadgen import run_clients

    cpu0 = time.process_time()  # after the imports: what the clients themselves cost
    sent = run_clients(url, tenants=TENANTS, clients=clients, seconds=seconds, rate=rate,
                       make_body=_Body(prefix, count, pools))
    # with the process's own CPU time: whether the clients, not the plane, are the limit
    out.put(([(s.sent_at, s.replied_at, s.ok, s.lease_ids, s.code) for s in sent],
             time.process_time() - cpu0))


def run_load(url: str, *, clients: int, processes: int, seconds: float, rate: float | None,
          run: str, count: int = 1, pools: tuple[str, ...] = (POOL,)
          ) -> tuple[list[Record], float]:
    """Client processes sharing `clients` connections (and `rate`, when open loop): their
    records, and the CPU seconds the client processes spent."""
    out = CTX.Queue()
    procs = []
    for p in range(processes):
        mine = clients // processes + (1 if p < clients % processes else 0)
        if mine == 0:
            continue
        share = None if rate is None else rate * mine / clients
        procs.append(CTX.Process(target=_client_process, daemon=True, args=(
            url, mine, seconds, share, f"{run}-p{p}", count, pools, out)))
    for proc in procs:
        proc.start()
    records: list[Record] = []
    cpu = 0.0
    for _ in procs:
        got, spent = await_ready(out, procs, "client", seconds + 120)
        records.extend(got)
        cpu += spent
    for proc in procs:
        proc.join(10)
    return records, cpu


def _stateless_rate(url: str, *, clients: int, processes: int, seconds: float,
                    run: str, server_pid: int | None = None) -> tuple[float, dict[str, Any]]:
    """Answered requests/s of the same closed loop against a responder that decodes each
    request and answers it, storing nothing (bench.bus_rates.serve_stateless_replies): the
    ceiling the clients, the server and one Python responder set on this machine. With it,
    the CPU ms per answered request of the server, the clients and the responder: what any
    plane's request costs before the plane does anything."""
    from bench.bus_rates import serve_stateless_replies
    from bus.subjects import command_subject

    stop, ready = CTX.Event(), CTX.Queue()
    subject = command_subject("any", "lease", "request").replace(".any.", ".*.")
    proc = CTX.Process(target=serve_stateless_replies, args=(url, subject, ready, stop),
                        daemon=True)
    proc.start()
    try:
        await_ready(ready, [proc], "stateless responder", 60)
        cpu0 = (cpu_seconds(server_pid), cpu_seconds(proc.pid))
        records, clients_cpu = run_load(url, clients=clients, processes=processes,
                                     seconds=seconds, rate=None, run=run)
        cpu1 = (cpu_seconds(server_pid), cpu_seconds(proc.pid))
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    answered = sum(1 for r in records if r[2])
    return answered / seconds, {
        "server": _per_request_ms(cpu0[0], cpu1[0], answered),
        "clients": _per_request_ms(0.0, clients_cpu, answered),
        "responder": _per_request_ms(cpu0[1], cpu1[1], answered)}


def _spread(url: str, pools: list[str], scheduler_pids: list[int | None],
            timeout: float = 60.0) -> dict[str, int]:
    """Wait until every pool has a leader and every scheduler process leads one; pool → the
    leading process's pid. Raises RuntimeError if they are not shared out in `timeout`."""
    from bus.leader import LeaderElection
    from workers.plane import holder_pid
    from workers.pool_leaders import pool_election_name

    observers = {pool: LeaderElection(url, name=pool_election_name(pool),
                                      holder_id="bench-observer") for pool in pools}
    deadline = time.monotonic() + timeout
    leaders: dict[str, int] = {}
    while time.monotonic() < deadline:
        leaders = {}
        for pool, observer in observers.items():
            record = observer.current_leader()
            pid = holder_pid(str((record or {}).get("holder") or ""))
            if pid is not None:
                leaders[pool] = pid
        if len(leaders) == len(pools) and set(leaders.values()) >= set(scheduler_pids):
            return leaders
        time.sleep(0.5)
    raise RuntimeError(f"the pools were not shared out over {len(scheduler_pids)} scheduler "
                       f"processes in {timeout:g} s: {leaders}")


def cpu_seconds(pid: int | None) -> float | None:
    """A process's CPU time so far (user + system), from /proc; None where there is none."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_msgs(server: Any) -> tuple[int, int] | None:
    """The server's messages in and out so far (its monitoring endpoint), or None."""
    import urllib.request

    if not getattr(server, "http_port", 0):
        return None
    try:
        with urllib.request.urlopen(f"http://{server.host}:{server.http_port}/varz",
                                    timeout=5) as r:
            varz = json.load(r)
    except (OSError, ValueError):
        return None
    return int(varz["in_msgs"]), int(varz["out_msgs"])


def _log_end(url: str) -> int:
    """The event stream's last sequence."""
    import asyncio

    from bus.connection import connect
    from bus.subjects import EVENTS_STREAM

    async def go() -> int:
        nc = await connect(url)
        try:
            return int((await nc.jetstream().stream_info(EVENTS_STREAM)).state.last_seq)
        finally:
            await nc.close()

    return asyncio.run(go())


def _cpu_of(pids: list[int | None]) -> float | None:
    """The CPU time so far of processes together; None when one cannot be read."""
    times = [cpu_seconds(pid) for pid in pids]
    return None if any(t is None for t in times) else sum(t for t in times if t is not None)


def _settled(url: str, pids: tuple[list[int | None], int | None], *,
             limit: float = 120.0) -> tuple[tuple[float | None, float | None], float]:
    """Wait until the dispatcher has followed the log to where it ends now (every order,
    timer and feed record of the events so far written: it saves its position after them).
    The CPU times at that moment, and when it came (monotonic)."""
    from bus.agentbus import ControlLink
    from workers.dispatcher import POSITION_KEY

    end = _log_end(url)
    link = ControlLink(url)
    deadline = time.monotonic() + limit
    try:
        while link.load_position(POSITION_KEY) < end and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        link.close()
    return (_cpu_of(pids[0]), cpu_seconds(pids[1])), time.monotonic()


def _per_request_ms(before: float | None, after: float | None, requests: int) -> float | None:
    if before is None or after is None or not requests:
        return None
    return (after - before) * 1000 / requests


def _phase(records: list[Record], reserved: dict[str, float],
           seconds: float) -> dict[str, Any]:
    ok = [r for r in records if r[2]]
    start = min((r[0] for r in records), default=0.0)
    end = start + seconds
    ids = [(r[0], lid) for r in ok for lid in r[3]]
    waits = [reserved[lid] - t for t, lid in ids if lid in reserved]
    in_window = sum(1 for _, lid in ids if reserved.get(lid, end + 1) <= end)
    errors: dict[str, int] = {}
    for r in records:
        if not r[2]:
            errors[r[4]] = errors.get(r[4], 0) + 1
    replies = [r[1] - r[0] for r in ok]
    return {
        "requests": len(records), "accepted": len(ok), "leases": len(ids), "errors": errors,
        "accepted_per_s": len(ok) / seconds, "leases_per_s": len(ids) / seconds,
        "reserved": len(waits), "reserved_per_s": in_window / seconds,
        "reply_p50_ms": ms(pct(replies, 0.5)), "reply_p99_ms": ms(pct(replies, 0.99)),
        "reserved_p50_ms": ms(pct(waits, 0.5)), "reserved_p99_ms": ms(pct(waits, 0.99)),
        "reserved_max_ms": ms(max(waits) if waits else None),
    }


def _drain(watcher: Any, records: list[Any], timeout: float) -> None:
    """Wait until every accepted lease is reserved (or `timeout`): latecomers still count."""
    want = {lid for r in records if r[2] for lid in r[3]}
    end = time.monotonic() + timeout
    while time.monotonic() < end and not want <= watcher.reserved.keys():
        time.sleep(0.1)


def run_e2e_bench(*, clients: int = 64, nodes: int = 1000, seconds: float = 10.0,
                  rate: float = 1000.0, steady_seconds: float = 10.0, count: int = 1,
                  processes: int | None = None, heartbeat_seconds: float = 10.0,
                  command_processes: int = 1, one_process: bool | None = None,
                  pools: int = 1, scheduler_processes: int = 1, quick: bool = False,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One run: raw batch ingest, then a saturating closed loop of `clients`, then `rate`
    requests/s offered for `steady_seconds`; every figure from the same server. The plane
    runs as `pool up` runs it: the scheduler's roles in a process of their own unless
    `one_process` (None: as `pool up` decides on this machine). With `pools` > 1 the nodes
    and the requests are dealt over that many pools, and `scheduler_processes` > 1 adds
    scheduler processes that share the pools' leadership out (workers.pool_leaders)."""
    from bench.bus_rates import raw_atomic_rate
    from bench.loadgen import FeedWatcher, stored_times
    from bus.admin import ensure_all_streams
    from bus.local.server import NatsServer, free_port
    from client.api import PoolClient
    from workers.processes import CHILD_ROLES, PARENT_ROLES, split_by_default

    if quick:
        clients, nodes, seconds = min(clients, 8), min(nodes, 20), min(seconds, 2.0)
        rate, steady_seconds = min(rate, 100.0), min(steady_seconds, 2.0)
    if (clients < 1 or nodes < 1 or seconds <= 0 or rate <= 0 or steady_seconds <= 0
            or command_processes < 1 or pools < 1 or scheduler_processes < 1):
        raise ValueError("clients, nodes, seconds, rate, steady seconds, pools and command "
                         "and scheduler processes must be positive")
    if nodes < pools:
        raise ValueError("every pool needs a node: nodes must be at least pools")
    processes = processes or max(1, min(clients, os.cpu_count() or 1))
    split = not one_process if one_process is not None else split_by_default()
    if scheduler_processes > 1 and not split:
        raise ValueError("more scheduler processes need the scheduler apart: not one process")
    names = pool_names(pools)
    say = progress or (lambda _s: None)
    run = uuid.uuid4().hex[:6]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pool-bench-e2e-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats", http_port=free_port()).start()
        stop, fleet_stop = CTX.Event(), CTX.Event()
        fleets: list[Any] = []
        ready = CTX.Queue()
        procs: list[Any] = []
        watcher = None
        grace = 3.0  # cut short (an error, SIGTERM, Ctrl-C): the children go at once
        try:
            url = server.url
            ensure_all_streams(url)
            say("raw atomic batches of 999…")
            raw = raw_atomic_rate(url)
            say(f"the same clients against a responder that stores nothing, {seconds:g} s…")
            server_pid = server.proc.pid if server.proc is not None else None
            floor, floor_cpu = _stateless_rate(url, clients=clients, processes=processes,
                                               seconds=seconds, run=f"{run}-floor",
                                               server_pid=server_pid)
            plane = CTX.Process(target=serve_plane, daemon=True, args=(
                url, ready, stop, list(PARENT_ROLES) if split else None))
            plane.start()
            procs.append(plane)
            await_ready(ready, procs, "plane", 120)
            plane_pids: list[int | None] = [plane.pid]
            # each plane process's roles, beside its pid ("all": every role in one process)
            plane_roles: list[str] = ["+".join(PARENT_ROLES) if split else "all"]
            if split:
                apart = CTX.Process(target=serve_plane, daemon=True,
                                     args=(url, ready, stop, list(CHILD_ROLES)))
                apart.start()
                procs.append(apart)
                await_ready(ready, procs, "plane", 120)
                plane_pids.append(apart.pid)
                plane_roles.append("+".join(CHILD_ROLES))
            # more responders in the queue group; more schedulers sharing the pools out
            scheduler_pids = plane_pids[-1:]
            for roles, n in ((["commands"], command_processes - 1),
                             (["scheduler"], scheduler_processes - 1)):
                for _ in range(n):
                    extra = CTX.Process(target=serve_plane, args=(url, ready, stop, roles),
                                         daemon=True)
                    extra.start()
                    procs.append(extra)
                    await_ready(ready, procs, "plane", 120)
                    plane_pids.append(extra.pid)
                    plane_roles.append("+".join(roles))
                    if roles == ["scheduler"]:
                        scheduler_pids.append(extra.pid)
            with PoolClient(url, timeout=30) as admin:
                for pool in names:
                    got = admin.admin("pool.set", {"pool_id": pool, **POOL_SETTINGS})
                    if not got.get("ok"):
                        raise RuntimeError(f"pool.set refused: {got}")
            say(f"registering {nodes} simulated nodes…")
            t0 = time.monotonic()
            fleet = CTX.Process(target=run_fleet, daemon=True,
                                 args=(url, nodes, heartbeat_seconds, ready, fleet_stop, names))
            fleet.start()
            fleets.append(fleet)
            await_ready(ready, fleets + procs, "simulated fleet", 600)
            register_s = time.monotonic() - t0
            leaders = (_spread(url, names, scheduler_pids) if scheduler_processes > 1
                       else None)
            watcher = FeedWatcher(url, TENANTS).start()
            run_load(url, clients=min(clients, 4), processes=1, seconds=0.5, rate=None,
                  run=f"{run}-warm", pools=tuple(names))
            log_start = _log_end(url)
            say(f"saturating: {clients} clients for {seconds:g} s…")
            cpu0 = (_cpu_of(plane_pids), cpu_seconds(server_pid))
            each0 = [cpu_seconds(pid) for pid in plane_pids]
            t0 = time.monotonic()
            msgs0 = _server_msgs(server)
            sat, clients_cpu = run_load(url, clients=clients, processes=processes,
                                     seconds=seconds, rate=None, run=f"{run}-sat", count=count,
                                     pools=tuple(names))
            cpu1 = (_cpu_of(plane_pids), cpu_seconds(server_pid))
            each1 = [cpu_seconds(pid) for pid in plane_pids]
            msgs1 = _server_msgs(server)
            _drain(watcher, sat, 30)
            cpu2, t2 = _settled(url, (plane_pids, server_pid))
            msgs2 = _server_msgs(server)
            saturated = _phase(sat, watcher.reserved, seconds)
            # CPU per accepted request over the saturating phase, by process: on a shared
            # machine the steadier measure of what a request costs (the plane's includes its
            # scheduler, dispatcher and the fleet's heartbeats over the same seconds)
            n = saturated["accepted"]
            saturated["cpu_ms_per_request"] = {
                "plane": _per_request_ms(cpu0[0], cpu1[0], n),
                "server": _per_request_ms(cpu0[1], cpu1[1], n),
                "clients": _per_request_ms(0.0, clients_cpu, n),
            }
            # the plane's share split by its processes, named by the roles each runs
            saturated["plane_cpu_ms_per_request"] = [
                {"roles": roles, "ms": _per_request_ms(a, b, n)}
                for roles, a, b in zip(plane_roles, each0, each1, strict=True)]
            # the same from the phase's start until the dispatcher caught up with the log: the
            # work the requests left behind included, and whatever else ran meanwhile
            saturated["settled_s"] = t2 - t0
            saturated["settled_cpu_ms_per_request"] = {
                "plane": _per_request_ms(cpu0[0], cpu2[0], n),
                "server": _per_request_ms(cpu0[1], cpu2[1], n)}
            saturated["settled_msgs_per_request"] = (
                None if msgs0 is None or msgs2 is None or not n else
                {"in": (msgs2[0] - msgs0[0]) / n, "out": (msgs2[1] - msgs0[1]) / n})
            # the server's messages in and out per accepted request over the same seconds
            # (heartbeats and the fleet's traffic included): what each request costs it
            saturated["server_msgs_per_request"] = (
                None if msgs0 is None or msgs1 is None or not n else
                {"in": (msgs1[0] - msgs0[0]) / n, "out": (msgs1[1] - msgs0[1]) / n})
            say(f"steady: {rate:g} requests/s offered for {steady_seconds:g} s…")
            st, _ = run_load(url, clients=clients, processes=processes, seconds=steady_seconds,
                          rate=rate, run=f"{run}-steady", count=count, pools=tuple(names))
            _drain(watcher, st, 30)
            steady = _phase(st, watcher.reserved, steady_seconds)
            # the stages, from the log's stored times, read now that the load is over
            requested, stored = stored_times(url, log_start)
            for phase, recs in ((saturated, sat), (steady, st)):
                phase["stages"] = stages(recs, requested, stored, watcher.reserved)
            grace = 30.0  # a run that ended well waits for its children's clean stop
        finally:
            # the fleet first: a node's beat in flight when the plane stops would find no
            # responder and say so
            end_children(fleet_stop, fleets, grace)
            end_children(stop, procs, grace)
            if watcher is not None:
                watcher.stop()
            server.stop()
    result: dict[str, Any] = {
        "clients": clients, "client_processes": processes, "nodes": nodes, "count": count,
        "seconds": seconds, "offered_per_s": rate, "steady_seconds": steady_seconds,
        "heartbeat_seconds": heartbeat_seconds, "register_s": register_s,
        "command_processes": command_processes, "plane_processes": len(plane_pids),
        # what the plane does not do here: no views are folded (no PostgreSQL), and no lease
        # is committed, so none is started on a node
        "views": False, "leases_committed": False,
        "pools": pools, "scheduler_processes": scheduler_processes, "pool_leaders": leaders,
        "raw_atomic_msgs_per_s": raw, "stateless_replies_per_s": floor,
        "stateless_cpu_ms_per_reply": floor_cpu, "cores": os.cpu_count() or 1,
        "saturated": saturated, "steady": steady,
        "machine": machine_line(), "quick": quick,
        "elapsed_s": time.monotonic() - started,
    }
    result["table"] = table(result)
    return result
