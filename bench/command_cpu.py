"""Per-command latency and CPU of the commands responder: one client takes leases through
request, commit and release over NATS, one step at a time, against a plane of its own."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench.children import end_children
from bench.e2e import cpu_seconds
from bench.soak import CTX, NODES, POOL, SHAPE, leader_bucket, serve

TENANT = "c0"
JOB = {"image": "local/job@sha256:" + "a" * 64, "command": ["true"]}


def _setup(admin: Any) -> None:
    setup: list[tuple[str, dict[str, Any]]] = [
        ("pool.set", {"pool_id": POOL, "commit_timeout_seconds": 3600, "packing": "spread",
                      "heartbeat_timeout_seconds": 86_400, "node_timeout_seconds": 86_400}),
        ("pool.prices", {"pool_id": POOL, "cpu_core_second": 1}),
        ("tenant.set", {"tenant": TENANT, "pool_id": POOL, "weight": 1.0}),
        ("credits.grant", {"tenant": TENANT, "amount_microcredits": 10**12,
                           "transfer_id": f"cpu-{TENANT}"}),
        *[("node.register", {"node_id": f"cpu-n{i}", "pool_id": POOL, "capabilities": {
            "allocatable": {"cpu_millis": 8000, "memory_mib": 65536, "gpu_count": 0,
                            "local_disk_gib": 100},
            "zone": "z1", "failure_domain": "z1"}}) for i in range(NODES)],
    ]
    for path, body in setup:
        got = admin.admin(path, body)
        if not got.get("ok"):
            raise RuntimeError(f"{path} refused: {got}")


def _step(pid: int, calls: list[Any]) -> dict[str, float]:
    """Run `calls` one after another: median wall ms each, responder CPU ms per call."""
    walls = []
    cpu0 = cpu_seconds(pid) or 0.0
    for call in calls:
        t0 = time.perf_counter()
        got = call()
        walls.append(time.perf_counter() - t0)
        if not got.get("ok"):
            raise RuntimeError(f"refused: {got}")
    cpu = (cpu_seconds(pid) or 0.0) - cpu0
    return {"wall_ms": statistics.median(walls) * 1000, "cpu_ms": cpu / len(calls) * 1000}


def run_command_cpu(*, leases: int = 300, warm: int = 50) -> dict[str, Any]:
    """`warm` leases through their life first (caches, imports), then `leases` more measured:
    all requested, all committed once reserved, all released."""
    from bus.admin import ensure_all_streams
    from bus.local.server import NatsServer
    from client.api import PoolClient

    with tempfile.TemporaryDirectory(prefix="pool-bench-cmdcpu-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats").start()
        stop, ready = CTX.Event(), CTX.Queue()
        procs, pids = [], {}
        try:
            url = server.url
            leader_bucket(url)
            ensure_all_streams(url)
            for role in ("scheduler", "commands"):
                p = CTX.Process(target=serve, daemon=True, args=(url, [role], ready, stop))
                p.start()
                procs.append(p)
                pids[role] = ready.get(timeout=120)
            with PoolClient(url, timeout=30) as admin:
                _setup(admin)
            result = {}
            with PoolClient(url, TENANT, timeout=60) as c:
                for phase, n in (("warm", warm), ("measured", leases)):
                    ids: list[str] = []

                    req = _step(pids["commands"], [partial(_request, c, phase, ids)] * n)
                    _reserved(c, ids)
                    com = _step(pids["commands"], [lambda lid=lid: c.lease(lid, "commit",
                                                                           {"job": JOB})
                                                   for lid in ids])
                    rel = _step(pids["commands"], [lambda lid=lid: c.lease(
                        lid, "release", {"exit_code": 0}) for lid in ids])
                    result = {"request": req, "commit": com, "release": rel}
            return {"leases": leases, **result}
        finally:
            end_children(stop, procs)
            server.stop()


def _request(c: Any, phase: str, ids: list[str]) -> dict[str, Any]:
    got: dict[str, Any] = c.request_lease({
        "pool_id": POOL, "shape": SHAPE, "maximum_runtime_seconds": 3600,
        "idempotency_key": f"cpu-{phase}-{len(ids)}-{time.time_ns()}"})
    if got.get("ok"):
        ids.append(got["lease"]["lease_id"])
    return got


def _reserved(c: Any, ids: list[str]) -> None:
    """Wait until the scheduler has reserved every lease in `ids`."""
    deadline = time.monotonic() + 120
    for lid in ids:
        while True:
            got = c.lease(lid, "get", {})
            state = (got.get("lease") or got.get("result") or {}).get("state")
            if state in ("reserved", "RESERVED"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"lease {lid} not reserved: {got}")
            time.sleep(0.02)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    print(json.dumps(run_command_cpu(leases=n)))
