"""`pool bench soak`: many leases through request → reserve → commit → release, with the
scheduler's resident memory and a cold scheduler's start-up replay time measured as they go."""

from __future__ import annotations

import collections
import gc
import json
import multiprocessing
import os
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.children import end_children
from bench.machine import machine_line

POOL = "soak"
NODES = 64  # room for every lease in flight, spread so releases rarely share a node
SHAPE = {"cpu_millis": 100, "memory_mib": 64}
BATCH = 10  # leases per request (one atomic save each)
CLIENTS = 32  # client threads: their saves share atomic batches
# the clients' tenants, several clients each: their releases settle the tenant's account
# concurrently. Few, so that every account's window of transfer ids is full early in the run
TENANTS = [f"s{i}" for i in range(8)]
RSS_AT = (0.1, 0.5, 1.0)  # fractions of the run where the scheduler's memory is judged
SAMPLE_AT = tuple(i / 10 for i in range(1, 11))  # and read, to show where it levels off
REPLAY_AT = (1 / 3, 2 / 3, 1.0)  # and where a cold scheduler replays the log
CTX = multiprocessing.get_context("spawn")  # the parent holds threads: no fork
# the scheduler's leadership leases: a loaded machine paused it past the default's few
# seconds, it stepped down and did not lead its pool again (docs/performance-log.md)
LEADER_TTL_SECONDS = 30.0
PROBE_FRAMES = 4  # frames kept per traced allocation with --probe
_PROBE_FILTERS = [tracemalloc.Filter(False, tracemalloc.__file__),
                  tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]


def serve(url: str, roles: list[str], ready: Any, stop: Any, probe: Any = None,
          leader_ttl_seconds: float = LEADER_TTL_SECONDS) -> None:
    """In a process of its own: control-plane `roles` without the data plane (no agents: a
    tenant's commit starts the lease, its release ends it). With `probe` (a queue of file
    paths), memory allocations are traced and each path asked for gets a snapshot of them and
    of the live objects by type (`--probe`)."""
    from workers.plane import ControlPlane

    if probe is not None:
        tracemalloc.start(PROBE_FRAMES)
    plane = ControlPlane(url, roles=roles, data_plane=False,
                         leader_ttl_seconds=leader_ttl_seconds).start()
    ready.put(os.getpid())
    while not stop.wait(0.2):
        if probe is not None and not probe.empty():
            _snapshot(probe.get())
    plane.stop()


def _snapshot(path: str) -> None:
    """This process's traced allocations (`path`) and its live objects by type (`path`.types),
    after a full collection; what that collection found unreachable, and the RSS and traced
    memory before and after it (`path`.gc)."""
    before = (rss_mib(os.getpid()), tracemalloc.get_traced_memory()[0] / 2**20, gc.get_count())
    found = gc.collect()
    after = (rss_mib(os.getpid()), tracemalloc.get_traced_memory()[0] / 2**20)
    Path(path + ".gc").write_text(json.dumps({"unreachable": found, "before": before,
                                              "after": after}))
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    Path(path + ".types").write_text(json.dumps(dict(counts)))
    tracemalloc.take_snapshot().dump(path)
    Path(path + ".done").touch()


def probe_diff(before: str, after: str, top: int = 15) -> list[str]:
    """What grew between two `_snapshot`s: the allocation sites and object types that grew
    most, largest first."""
    old = tracemalloc.Snapshot.load(before).filter_traces(_PROBE_FILTERS)
    new = tracemalloc.Snapshot.load(after).filter_traces(_PROBE_FILTERS)
    lines = []
    for stat in new.compare_to(old, "traceback")[:top]:
        frames = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback)
        lines.append(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8,} blocks  {frames}")
    a = json.loads(Path(before + ".types").read_text())
    b = json.loads(Path(after + ".types").read_text())
    grew = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
    lines.append("  objects that grew: " + ", ".join(f"{k} {d:+,}" for d, k in grew[:top] if d))
    g = json.loads(Path(after + ".gc").read_text())
    lines.append(f"  a full collection found {g['unreachable']:,} unreachable objects; RSS "
                 f"{g['before'][0]:.1f} → {g['after'][0]:.1f} MiB, traced "
                 f"{g['before'][1]:.1f} → {g['after'][1]:.1f} MiB (collector counts "
                 f"{g['before'][2]})")
    return lines


def leader_bucket(url: str, ttl_seconds: float = LEADER_TTL_SECONDS) -> None:
    """The leader bucket, made with `ttl_seconds` as its keys' time to live."""
    from bus.admin import admin_connect, admin_run
    from bus.leader import ensure_leader_bucket

    async def go() -> None:
        nc = await admin_connect(url)
        try:
            await ensure_leader_bucket(nc.jetstream(), ttl_seconds=ttl_seconds)
        finally:
            await nc.close()

    admin_run(go())


def _replay(url: str, out: Any) -> None:
    """In a fresh process: how long a scheduler takes to fold the whole log at start-up."""
    from workers.application import PoolApp
    from workers.bootstrap import app_env
    from workers.scheduler import Scheduler

    t0 = time.monotonic()
    scheduler = Scheduler(PoolApp(env=app_env(url)))
    events = scheduler.catch_up()
    took = time.monotonic() - t0
    scheduler.close()
    scheduler.app.close()
    out.put((took, events))


def _probe(probes: Any, path: Path) -> str:
    """Ask the scheduler's process for a `_snapshot` at `path` and wait for it."""
    probes.put(str(path))
    done = Path(str(path) + ".done")
    deadline = time.monotonic() + 600
    while not done.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler took no memory snapshot")
        time.sleep(0.2)
    return str(path)


def warm_up() -> int:
    """Leases after which the scheduler's count-bounded memories are full: the last
    ENDED_REMEMBERED ended leases (for `why`) and each tenant account's window of
    TRANSFER_WINDOW lease movements (two a lease: its hold and its settlement)."""
    from domain.account import TRANSFER_WINDOW
    from workers.scheduler.state import ENDED_REMEMBERED

    return max(ENDED_REMEMBERED, len(TENANTS) * TRANSFER_WINDOW // 2)


def rss_mib(pid: int) -> float:
    """A process's resident set size in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class _Driver:
    """Client threads taking leases through their whole life until `target` have ended; they
    stay connected between targets (`run_until` raises it, `close` ends them)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = 0  # leases taken by a client
        self.ended = 0  # and taken through to their release (or an error)
        self.errors: dict[str, int] = {}
        self.retried = 0  # releases sent again after a write conflict
        # client seconds spent per step, all clients together, and commits refused (not yet
        # reserved): where a lease's time goes
        self.spent = {"request": 0.0, "commit": 0.0, "release": 0.0}
        self.commits_early = 0
        self._lock = threading.Condition()
        self._target = 0
        self._closed = False
        self._threads: list[threading.Thread] = []

    def run_until(self, target: int) -> None:
        """Return once `target` leases have ended, the clients idle."""
        with self._lock:
            self._target = target
            self._lock.notify_all()
        if not self._threads:
            self._threads = [threading.Thread(target=self._client, daemon=True,
                                              args=(TENANTS[i % len(TENANTS)], i))
                             for i in range(CLIENTS)]
            for t in self._threads:
                t.start()
        with self._lock:
            while self.ended < target and any(t.is_alive() for t in self._threads):
                self._lock.wait(0.5)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for t in self._threads:
            t.join(60)

    def _take(self) -> int:
        """The next batch's size; waits while the target is reached, 0 once closed."""
        with self._lock:
            while not self._closed and self.done >= self._target:
                self._lock.wait()
            if self._closed:
                return 0
            n = min(BATCH, self._target - self.done)
            self.done += n
            return n

    def _ended(self, n: int) -> None:
        with self._lock:
            self.ended += n
            self._lock.notify_all()

    def _error(self, code: str) -> None:
        with self._lock:
            self.errors[code] = self.errors.get(code, 0) + 1

    def _client(self, tenant: str, i: int) -> None:
        from client.api import PoolClient

        with PoolClient(self.url, tenant, timeout=60) as c:
            while (n := self._take()) > 0:
                key = f"soak-{i}-{time.monotonic_ns()}"
                body: dict[str, Any] = {"pool_id": POOL, "shape": SHAPE,
                                        "maximum_runtime_seconds": 3600,
                                        "idempotency_key": key}
                if n > 1:
                    body["count"] = n
                t0 = time.monotonic()
                got = c.request_lease(body)
                t1 = time.monotonic()
                if not got.get("ok"):
                    self._error(str(got.get("error", {}).get("code")))
                    self._ended(n)
                    continue
                ids = list((got.get("result") or {}).get("lease_ids") or
                           [got["lease"]["lease_id"]])
                for lid in ids:
                    t2 = time.monotonic()
                    self._commit(c, lid)
                    t3 = time.monotonic()
                    for _ in range(10):  # a write conflict (the node or account moved): again
                        r = c.lease(lid, "release", {"exit_code": 0})
                        if r.get("ok") or r.get("error", {}).get("code") != "write_conflict":
                            break
                        self.retried += 1
                    if not r.get("ok"):
                        self._error(str(r.get("error", {}).get("code")))
                    with self._lock:
                        self.spent["commit"] += t3 - t2
                        self.spent["release"] += time.monotonic() - t3
                with self._lock:
                    self.spent["request"] += t1 - t0
                self._ended(n)

    def _commit(self, c: Any, lid: str) -> None:
        """Commit once the scheduler reserved it (a queued lease's commit is refused)."""
        wait = 0.005
        deadline = time.monotonic() + 120
        while True:
            r = c.lease(lid, "commit", {"job": {"image": "local/job@sha256:" + "a" * 64,
                                                "command": ["true"]}})
            if r.get("ok"):
                return
            if time.monotonic() > deadline:
                self._error(str(r.get("error", {}).get("code")))
                return
            with self._lock:
                self.commits_early += 1
            time.sleep(wait)
            wait = min(wait * 2, 0.2)


def run_soak(*, leases: int = 1_000_000, quick: bool = False, probe: bool = False,
             settle_seconds: float = 1.0, leader_ttl_seconds: float = LEADER_TTL_SECONDS,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run `leases` leases (2,000 with `quick`) through their whole life against a server and
    control plane of their own; the scheduler's RSS at RSS_AT and a cold start-up replay at
    REPLAY_AT of the run. With `probe`, the scheduler traces its allocations and what grew
    from the first tenth to each later one is said through `progress`. `settle_seconds`: the
    pause at each mark before the scheduler's memory is read; `leader_ttl_seconds`: the
    scheduler's leadership leases (it takes up the pool within a third of it)."""
    from bus.admin import ensure_all_streams
    from bus.local.server import NatsServer
    from client.api import PoolClient

    if quick:
        leases = min(leases, 2_000)
    if leases < 10:
        raise ValueError("a soak needs at least 10 leases")
    say = progress or (lambda _s: None)
    marks = sorted({round(leases * f) for f in (*SAMPLE_AT, *RSS_AT, *REPLAY_AT)})
    started = time.monotonic()
    rss: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    replays: list[dict[str, Any]] = []
    snaps: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pool-bench-soak-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats").start()
        stop = CTX.Event()
        ready = CTX.Queue()
        procs: list[Any] = []
        driver: _Driver | None = None
        try:
            url = server.url
            # before the streams: they keep a bucket's TTL as it is
            leader_bucket(url, leader_ttl_seconds)
            ensure_all_streams(url)
            pids = {}
            probes = CTX.Queue() if probe else None
            for role in ("scheduler", "commands"):
                p = CTX.Process(target=serve, daemon=True, args=(
                    url, [role], ready, stop, probes if role == "scheduler" else None,
                    leader_ttl_seconds))
                p.start()
                procs.append(p)
                pids[role] = ready.get(timeout=120)
            setup: list[tuple[str, dict[str, Any]]] = [
                ("pool.set", {"pool_id": POOL, "commit_timeout_seconds": 3600,
                              "packing": "spread",
                              "heartbeat_timeout_seconds": 86_400,
                              "node_timeout_seconds": 86_400}),
                ("pool.prices", {"pool_id": POOL, "cpu_core_second": 1}),
                *[("tenant.set", {"tenant": t, "pool_id": POOL, "weight": 1.0})
                  for t in TENANTS],
                *[("credits.grant", {"tenant": t, "amount_microcredits": 10**12,
                                     "transfer_id": f"soak-{t}"}) for t in TENANTS],
                *[("node.register", {"node_id": f"soak-n{i}", "pool_id": POOL,
                                     "capabilities": {"allocatable": {
                                         "cpu_millis": 8000, "memory_mib": 65536,
                                         "gpu_count": 0, "local_disk_gib": 100},
                                         "zone": "z1", "failure_domain": "z1"}})
                  for i in range(NODES)],
            ]
            with PoolClient(url, timeout=30) as admin:
                for path, body in setup:
                    got = admin.admin(path, body)
                    if not got.get("ok"):
                        raise RuntimeError(f"{path} refused: {got}")
            rss.append({"leases": 0, "rss_mib": rss_mib(pids["scheduler"])})
            driver = _Driver(url)
            say(f"the scheduler's memory is judged from the first tenth past {warm_up():,} "
                "leases")
            driving = 0.0  # seconds the clients ran, the pauses at each mark left out
            for mark in marks:
                t0 = time.monotonic()
                driver.run_until(mark)
                driving += time.monotonic() - t0
                time.sleep(settle_seconds)  # the scheduler folds the last releases
                now_rss = {"leases": mark, "rss_mib": rss_mib(pids["scheduler"])}
                say(f"{mark:,} leases ended ({mark / driving:,.0f}/s; "
                    f"{time.strftime('%H:%M:%S')}; scheduler RSS {now_rss['rss_mib']:.1f} MiB)")
                if any(mark == round(leases * f) for f in SAMPLE_AT):
                    samples.append(now_rss)
                    if probes is not None:
                        snaps.append(_probe(probes, Path(tmp) / f"probe-{mark}"))
                        if len(snaps) > 1:
                            say(f"grew from {samples[0]['leases']:,} to {mark:,} leases:")
                            for line in probe_diff(snaps[0], snaps[-1]):
                                say(line)
                if any(mark == round(leases * f) for f in RSS_AT):
                    rss.append(now_rss)
                if any(mark == round(leases * f) for f in REPLAY_AT):
                    out = CTX.Queue()
                    p = CTX.Process(target=_replay, args=(url, out), daemon=True)
                    p.start()
                    took, events = out.get(timeout=3600)
                    p.join(30)
                    replays.append({"leases": mark, "seconds": took, "events": events})
        finally:
            if driver is not None:
                driver.close()
            end_children(stop, procs)
            server.stop()
    loaded = [r for r in rss if r["leases"] > 0]
    # judged once every count-bounded memory is full: from the first tenth past warm_up()
    warm = warm_up()
    judged = next((r for r in samples if r["leases"] >= warm), loaded[0])
    first, last = judged["rss_mib"], loaded[-1]["rss_mib"]
    result: dict[str, Any] = {
        "leases": leases, "clients": CLIENTS, "batch": BATCH, "nodes": NODES,
        "rss": rss, "rss_samples": samples, "replays": replays, "errors": driver.errors,
        "release_retries": driver.retried,
        # per lease, in client milliseconds: each step's mean (a request carries BATCH leases)
        "client_ms_per_lease": {k: 1000 * v / leases for k, v in driver.spent.items()},
        "commits_before_reserved": driver.commits_early,
        "warm_up_leases": warm, "judged_from": judged["leases"],
        "rss_growth": last / first - 1, "flat": abs(last / first - 1) <= 0.10,
        "leases_per_s": leases / driving, "elapsed_s": time.monotonic() - started,
        "machine": machine_line(), "quick": quick,
    }
    result["table"] = table(result)
    return result


def table(result: dict[str, Any]) -> str:
    lines = [(f"soak: {result['leases']:,} leases, request → reserve → commit → release "
              f"({result['leases_per_s']:,.0f} leases/s)")]
    for r in result["rss"]:
        lines.append(f"  scheduler RSS after {r['leases']:>9,} leases: "
                     f"{r['rss_mib']:8.1f} MiB")
    lines.append("  RSS at each tenth: " + ", ".join(f"{r['rss_mib']:.0f}"
                                                    for r in result["rss_samples"]) + " MiB")
    for r in result["replays"]:
        lines.append(f"  start-up replay after {r['leases']:>9,} leases: {r['seconds']:8.2f} s "
                     f"({r['events']:,} events)")
    warm = (f"the caches full at {result['warm_up_leases']:,}"
            if result["judged_from"] >= result["warm_up_leases"]
            else f"before the caches are full, at {result['warm_up_leases']:,}")
    lines.append(f"  RSS from {result['judged_from']:,} leases ({warm}) to the last: "
                 f"{result['rss_growth']:+.1%} "
                 f"({'flat' if result['flat'] else 'NOT flat'}: within 10% is flat)")
    lines.append(f"  releases sent again after a write conflict: {result['release_retries']:,}")
    ms = result["client_ms_per_lease"]
    lines.append(f"  client time per lease: request {ms['request']:.1f} ms (a tenth of a "
                 f"batch's), commit {ms['commit']:.1f} ms, release {ms['release']:.1f} ms; "
                 f"commits sent before the reservation: {result['commits_before_reserved']:,}")
    if result["errors"]:
        lines.append(f"  errors: {result['errors']}")
    lines.append(f"  {result['machine']}")
    return "\n".join(lines)
