"""Shared set-up for the control-plane tests: a real server, the real workers, a fake clock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bus.replies import node_inbox
from client.api import PoolClient
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.plane import ControlPlane
from workers.scheduler import Scheduler


@dataclass
class FakeClock:
    now: float = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def node_body(node_id: str, pool: str = "p1", *, cpu_millis: int = 8000, memory_mib: int = 32768,
              gpu_count: int = 0, gpu_model: str | None = None, gpu_memory_gib: int = 0,
              zone: str = "z1", **traits: Any) -> dict[str, Any]:
    caps: dict[str, Any] = {
        "allocatable": {"cpu_millis": cpu_millis, "memory_mib": memory_mib,
                        "gpu_count": gpu_count, "local_disk_gib": 100},
        "zone": zone, "failure_domain": zone, "gpu_memory_gib": gpu_memory_gib,
        **traits,
    }
    if gpu_model:
        caps["gpu_model"] = gpu_model
    return {"node_id": node_id, "pool_id": pool, "capabilities": caps}


def lease_body(key: str, pool: str = "p1", *, cpu_millis: int = 1000, memory_mib: int = 1024,
               max_runtime: int = 600, priority: str = "standard", **shape: Any) -> dict[str, Any]:
    return {
        "pool_id": pool,
        "shape": {"cpu_millis": cpu_millis, "memory_mib": memory_mib, **shape},
        "maximum_runtime_seconds": max_runtime,
        "idempotency_key": key,
        "priority_class": priority,
    }


def setup_pool(admin: PoolClient, pool: str = "p1", *, tenants: dict[str, float] | None = None,
               credits: int = 10**12, **config: Any) -> None:
    classes = config.pop("priority_classes", {"preemptible": 0, "standard": 10, "high": 20})
    r = admin.admin("pool.set", {"pool_id": pool, "priority_classes": classes, **config})
    assert r["ok"], r
    for tenant, weight in (tenants or {"alpha": 1.0}).items():
        # the tests' tenants may use every class (a tenant's default: the pool's default only)
        assert admin.admin("tenant.set", {"tenant": tenant, "pool_id": pool, "weight": weight,
                                          "priority_classes": sorted(classes)})["ok"]
        assert admin.admin("credits.grant", {"tenant": tenant, "amount_microcredits": credits,
                                             "transfer_id": f"initial-{tenant}"})["ok"]


def node_report(nats_url: str, node: str, lease_id: str, verb: str,
                body: dict[str, Any]) -> dict[str, Any]:
    """An agent's report on a lease (`stopped`, `started`, …), sent as that node's agent is
    answered: under the node's own inbox."""
    with PoolClient(nats_url, inbox_prefix=node_inbox(node).encode()) as agent:
        return agent.call(f"pool.node.{node}.lease.{lease_id}.{verb}", body)


Plane = tuple[ControlPlane, PoolClient, FakeClock]  # a hand-driven plane, its admin, its clock


def start(nats_url: str, clock: FakeClock) -> ControlPlane:
    """A plane whose scheduler the test drives by hand (`cp.scheduler.cycle()`), answering
    `why` from it."""
    return ControlPlane(nats_url, clock=clock, run_scheduler=False, serve_why=True).start()


def threaded_subjects(cp: ControlPlane) -> list[str]:
    """The subjects the plane's command service answers on a worker thread from now on (the
    rest it answers on the bus's loop), in order."""
    assert cp.commands is not None
    threaded: list[str] = []
    for lane in cp.lanes:  # nodes, commands, reads: each hands its own to its threads
        handler = lane.handler

        def counting(subject: str, body: bytes, headers: dict[str, str],
                     handler: Any = handler) -> bytes:
            threaded.append(subject)
            return handler(subject, body, headers)  # type: ignore[no-any-return]

        lane.handler = counting
    return threaded


def rival_schedulers(cp: ControlPlane, clock: FakeClock, n: int = 2) -> list[Scheduler]:
    """`n` schedulers of their own on `cp`'s log, each with its own application."""
    return [Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
            for _ in range(n)]


def race(rivals: list[Scheduler], run: Callable[[Scheduler], None],
         timeout: float = 60.0) -> None:
    """`run` each scheduler on a thread of its own, all let go at once; fails when one raised
    or had not ended within `timeout`."""
    barrier = threading.Barrier(len(rivals))
    errors: list[BaseException] = []

    def go(s: Scheduler) -> None:
        barrier.wait()
        try:
            run(s)
        except Exception as e:  # noqa: BLE001 - a cycle that raised must fail the test
            errors.append(e)

    threads = [threading.Thread(target=go, args=(s,)) for s in rivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads) and not errors, errors
