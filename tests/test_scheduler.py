"""The scheduler against a real log: fair share, reasons, credits, quotas, and no double placement."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from bus.server import NatsServer
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.app import PoolApp
from workers.client import PoolClient
from workers.replay import check_placements
from workers.scheduler import Scheduler
from workers.serve import ControlPlane, app_env

Plane = tuple[ControlPlane, PoolClient, FakeClock]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    yield cp, admin, clock
    admin.close()
    cp.stop()


def _placed_by_tenant(cp: ControlPlane) -> Counter[str]:
    out: Counter[str] = Counter()
    for agg in cp.scheduler.aggregates.values():
        if type(agg).__name__ == "Lease" and agg.state.value == "reserved":  # type: ignore[attr-defined]
            out[agg.tenant_id] += 1  # type: ignore[attr-defined]
    return out


def test_weighted_fair_share_splits_a_full_pool_by_weight(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 2.0, "beta": 1.0})
    for i in range(3):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=4096))
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        for i in range(12):  # each wants far more than the pool's 12 cores
            assert a.request_lease(lease_body(f"a{i}"))["ok"]
            assert b.request_lease(lease_body(f"b{i}"))["ok"]
    cp.scheduler.cycle()
    placed = _placed_by_tenant(cp)
    assert placed == {"alpha": 8, "beta": 4}  # DRF with weights 2:1 over 12 equal slots


def test_a_request_no_node_could_ever_hold_is_rejected_with_filter_counts(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("cpu1"))
    admin.admin("node.register", node_body("gpu1", gpu_count=2, gpu_model="a100", gpu_memory_gib=40))
    with PoolClient(cp.nats_url, "alpha") as a:
        lid = a.request_lease(lease_body("huge-gpu", gpu_count=1, gpu_memory_gib_min=80))["lease"]["lease_id"]
        assert cp.scheduler.cycle().rejected == 1
        assert a.lease(lid, "get")["lease"]["state"] == "rejected"
        why = a.lease(lid, "why")
        assert why["ok"], why
        filters = why["result"]["reasons"]["filters"]
        assert filters["insufficient_gpu_memory"] == 2  # a node may fail several filters
        assert filters["insufficient_gpu"] == 1  # the CPU node has no GPU at all
        assert why["result"]["reasons"]["never_satisfiable"] is True


def test_a_busy_pool_says_why_a_request_waits(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=2000))
    admin.admin("node.register", node_body("n2", cpu_millis=2000))
    admin.admin("node/n2/cordon".replace("/", "."), {"reason": "disk"})
    with PoolClient(cp.nats_url, "alpha") as a:
        a.request_lease(lease_body("fill", cpu_millis=2000))
        cp.scheduler.cycle()
        lid = a.request_lease(lease_body("wait", cpu_millis=2000))["lease"]["lease_id"]
        cp.scheduler.cycle()
        reasons = a.lease(lid, "why")["result"]["reasons"]
    assert reasons["filters"] == {"node_cordoned": 1, "insufficient_cpu": 1}
    assert "waiting_for_capacity" in reasons["tenant"]
    assert reasons["never_satisfiable"] is False


def test_a_tenant_without_credit_for_the_hold_waits_with_insufficient_credits(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, credits=1)
    # a price list makes the hold non-zero: 1 credit per core-second
    assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 1_000_000})["ok"]
    admin.admin("node.register", node_body("n1"))
    with PoolClient(cp.nats_url, "alpha") as a:
        lid = a.request_lease(lease_body("pricey"))["lease"]["lease_id"]
        cp.scheduler.cycle()
        why = a.lease(lid, "why")["result"]
    assert why["state"] == "queued"
    assert why["reasons"]["tenant"] == ["insufficient_credits"]


def test_a_tenant_over_its_quota_waits_with_quota_exceeded(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1", "weight": 1.0,
                                      "quota": {"cpu_millis": 1000}})["ok"]
    admin.admin("node.register", node_body("n1"))
    with PoolClient(cp.nats_url, "alpha") as a:
        a.request_lease(lease_body("q1"))
        second = a.request_lease(lease_body("q2"))["lease"]["lease_id"]
        cp.scheduler.cycle()
        assert a.lease(second, "why")["result"]["reasons"]["tenant"] == ["quota_exceeded"]


def test_concurrent_schedulers_never_double_place(plane: Plane) -> None:
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    for i in range(4):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=8192))
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        for i in range(30):
            a.request_lease(lease_body(f"a{i}"))
            b.request_lease(lease_body(f"b{i}"))
    rivals = [Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock) for _ in range(2)]
    barrier = threading.Barrier(len(rivals))

    def race(s: Scheduler) -> None:
        barrier.wait()
        for _ in range(6):
            s.cycle()

    threads = [threading.Thread(target=race, args=(s,)) for s in rivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(1 for _ in threads if _.is_alive()) == 0
    report = check_placements(cp.app)  # every node, every instant: leases fit, none held twice
    assert report.double_placements == 0, report.over_allocations + report.double_holds
    assert report.placements > 0
    reserved = sum(1 for agg in rivals[0].aggregates.values()
                   if type(agg).__name__ == "Lease" and agg.state.value == "reserved")  # type: ignore[attr-defined]
    rivals[0].cycle()
    assert reserved <= 16  # 4 nodes × 4 cores, 1 core each
    for s in rivals:
        s.app.close()
