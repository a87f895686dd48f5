"""`pool bench soak`: many leases through request → reserve → commit → release, with the
scheduler's resident memory and a cold scheduler's start-up replay time measured as they go."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.machine import machine_line

POOL = "soak"
NODES = 64  # room for every lease in flight, spread so releases rarely share a node
SHAPE = {"cpu_millis": 100, "memory_mib": 64}
BATCH = 10  # leases per request (one atomic save each)
CLIENTS = 32  # client threads, each a tenant's: their saves share atomic batches
# a tenant per client: a release settles the tenant's account, so clients of one tenant would
# contend on it
TENANTS = [f"s{i}" for i in range(CLIENTS)]
RSS_AT = (0.1, 0.5, 1.0)  # fractions of the run where the scheduler's memory is judged
SAMPLE_AT = tuple(i / 10 for i in range(1, 11))  # and read, to show where it levels off
REPLAY_AT = (1 / 3, 2 / 3, 1.0)  # and where a cold scheduler replays the log
_CTX = multiprocessing.get_context("spawn")  # the parent holds threads: no fork


def _serve(url: str, roles: list[str], ready: Any, stop: Any) -> None:
    """In a process of its own: control-plane `roles` without the data plane (no agents: a
    tenant's commit starts the lease, its release ends it)."""
    from control.plane import ControlPlane

    plane = ControlPlane(url, roles=roles, data_plane=False).start()
    ready.put(os.getpid())
    stop.wait()
    plane.stop()


def _replay(url: str, out: Any) -> None:
    """In a fresh process: how long a scheduler takes to fold the whole log at start-up."""
    from control.application import PoolApp
    from control.bootstrap import app_env
    from control.scheduler import Scheduler

    t0 = time.monotonic()
    scheduler = Scheduler(PoolApp(env=app_env(url)))
    events = scheduler.catch_up()
    took = time.monotonic() - t0
    scheduler.close()
    scheduler.app.close()
    out.put((took, events))


def rss_mib(pid: int) -> float:
    """A process's resident set size in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class _Driver:
    """Client threads taking leases through their whole life until `target` have ended."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = 0
        self.errors: dict[str, int] = {}
        self.retried = 0  # releases sent again after a write conflict
        self._lock = threading.Lock()
        self._target = 0

    def run_until(self, target: int) -> None:
        self._target = target
        threads = [threading.Thread(target=self._client, args=(TENANTS[i % len(TENANTS)], i),
                                    daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _take(self) -> int:
        with self._lock:
            n = min(BATCH, self._target - self.done)
            self.done += max(0, n)
            return max(0, n)

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
                got = c.request_lease(body)
                if not got.get("ok"):
                    self._error(str(got.get("error", {}).get("code")))
                    continue
                ids = list((got.get("result") or {}).get("lease_ids") or
                           [got["lease"]["lease_id"]])
                for lid in ids:
                    self._commit(c, lid)
                    for _ in range(10):  # a write conflict (the node or account moved): again
                        r = c.lease(lid, "release", {"exit_code": 0})
                        if r.get("ok") or r.get("error", {}).get("code") != "write_conflict":
                            break
                        self.retried += 1
                    if not r.get("ok"):
                        self._error(str(r.get("error", {}).get("code")))

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
            time.sleep(wait)
            wait = min(wait * 2, 0.2)


def run_soak(*, leases: int = 1_000_000, quick: bool = False,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run `leases` leases (2,000 with `quick`) through their whole life against a server and
    control plane of their own; the scheduler's RSS at RSS_AT and a cold start-up replay at
    REPLAY_AT of the run."""
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
    with tempfile.TemporaryDirectory(prefix="pool-bench-soak-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats").start()
        stop = _CTX.Event()
        ready = _CTX.Queue()
        procs: list[Any] = []
        try:
            url = server.url
            ensure_all_streams(url)
            pids = {}
            for role in ("scheduler", "commands"):
                p = _CTX.Process(target=_serve, args=(url, [role], ready, stop), daemon=True)
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
            t0 = time.monotonic()
            for mark in marks:
                driver.run_until(mark)
                time.sleep(1.0)  # the scheduler folds the last releases
                say(f"{mark:,} leases ended ({mark / (time.monotonic() - t0):,.0f}/s)")
                now_rss = {"leases": mark, "rss_mib": rss_mib(pids["scheduler"])}
                if any(mark == round(leases * f) for f in SAMPLE_AT):
                    samples.append(now_rss)
                if any(mark == round(leases * f) for f in RSS_AT):
                    rss.append(now_rss)
                if any(mark == round(leases * f) for f in REPLAY_AT):
                    out = _CTX.Queue()
                    p = _CTX.Process(target=_replay, args=(url, out), daemon=True)
                    p.start()
                    took, events = out.get(timeout=3600)
                    p.join(30)
                    replays.append({"leases": mark, "seconds": took, "events": events})
            elapsed = time.monotonic() - t0
        finally:
            stop.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
            server.stop()
    loaded = [r for r in rss if r["leases"] > 0]
    first, last = loaded[0]["rss_mib"], loaded[-1]["rss_mib"]
    result: dict[str, Any] = {
        "leases": leases, "clients": CLIENTS, "batch": BATCH, "nodes": NODES,
        "rss": rss, "rss_samples": samples, "replays": replays, "errors": driver.errors,
        "release_retries": driver.retried,
        "rss_growth": last / first - 1, "flat": abs(last / first - 1) <= 0.10,
        "leases_per_s": leases / elapsed, "elapsed_s": time.monotonic() - started,
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
    lines.append(f"  RSS from the first mark to the last: {result['rss_growth']:+.1%} "
                 f"({'flat' if result['flat'] else 'NOT flat'}: within 10% is flat)")
    lines.append(f"  releases sent again after a write conflict: {result['release_retries']:,}")
    if result["errors"]:
        lines.append(f"  errors: {result['errors']}")
    lines.append(f"  {result['machine']}")
    return "\n".join(lines)
