"""The simulator measures the product's policy: the same workload through the real scheduler
(over a real log, on a fake clock) and through the simulator starts every request at the same
time on the same node."""

from __future__ import annotations

from client.api import PoolClient
from domain.poolconfig import PoolConfig
from domain.resources import NodeCapabilities, Resources, Shape
from sim import DRF, DRF_BACKFILL, Policy, SimNode, SimRequest, Simulator, Tenant, Workload
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}
STEP = 60.0
CLASSES = (("preemptible", 0), ("standard", 10), ("high", 20))  # as setup_pool sets them
NODES = (("n1", 4000), ("n2", 2000), ("n3", 8000))
TENANTS = {"alpha": 1.0, "beta": 2.0, "gamma": 1.0}
# (key, tenant, arrival s, cores in millis, maximum runtime s, actual runtime s)
REQUESTS = (
    ("a1", "alpha", 0, 2000, 600, 300), ("a2", "alpha", 0, 2000, 900, 500),
    ("b1", "beta", 0, 4000, 1200, 900), ("g1", "gamma", 0, 8000, 600, 400),
    ("a3", "alpha", 0, 1000, 300, 200), ("b2", "beta", 60, 2000, 600, 600),
    ("g2", "gamma", 60, 8000, 1800, 700), ("a4", "alpha", 120, 4000, 900, 100),
    ("b3", "beta", 180, 1000, 300, 290), ("a5", "alpha", 240, 1000, 1200, 1100),
    ("g3", "gamma", 300, 2000, 300, 120), ("b4", "beta", 420, 8000, 600, 300),
    ("a6", "alpha", 480, 2000, 600, 60), ("b5", "beta", 600, 1000, 600, 580),
    ("g4", "gamma", 660, 1000, 300, 30), ("a7", "alpha", 700, 2000, 2400, 2000),
)
MEMORY = 1024


def _workload() -> Workload:
    nodes = tuple(SimNode(n, NodeCapabilities(allocatable=Resources(cpu, 32768, 0, 100)))
                  for n, cpu in NODES)
    reqs = tuple(SimRequest(k, t, float(at), Shape.build(cpu_millis=cpu, memory_mib=MEMORY),
                            float(ran), mx, priority_class="standard")
                 for k, t, at, cpu, mx, ran in REQUESTS)
    return Workload(nodes, tuple(Tenant(t, "", w) for t, w in TENANTS.items()), reqs, 700.0)


def _simulated(policy: Policy) -> dict[str, tuple[float, str]]:
    cfg = PoolConfig(priority_classes=CLASSES, default_priority_class="standard",
                     fair_share_half_life_seconds=int(policy.half_life_seconds))
    result = Simulator(_workload(), policy, config=cfg, cycle_seconds=STEP).run()
    out = {}
    for o in result.outcomes:
        assert o.started_at is not None and o.node_id is not None
        out[o.request.request_id] = (o.started_at, o.node_id)
    return out


def _scheduled(plane: tuple[ControlPlane, PoolClient, FakeClock], backfill: bool,
               half_life_seconds: int = 0) -> dict[str, tuple[float, str]]:
    cp, admin, clock = plane
    cp.scheduler.backfill = backfill
    # no heartbeats are sent here: the lease term and heartbeat timeout outlast every run
    setup_pool(admin, tenants=TENANTS, default_lease_seconds=3600,
               heartbeat_timeout_seconds=3600,
               fair_share_half_life_seconds=half_life_seconds)
    for node_id, cpu in NODES:
        assert admin.admin("node.register", node_body(node_id, cpu_millis=cpu))["ok"]
    clients = {t: PoolClient(cp.nats_url, t) for t in TENANTS}
    t0 = clock()
    ids: dict[str, tuple[str, str]] = {}  # key → (tenant, lease id)
    started: dict[str, tuple[float, str]] = {}
    ends: dict[str, float] = {}
    runtime = {k: ran for k, _, _, _, _, ran in REQUESTS}
    try:
        step = 0
        while len(started) < len(REQUESTS):
            now = step * STEP
            clock.now = t0 + now
            for key, at in sorted(ends.items()):
                if at <= now:
                    tenant, lid = ids[key]
                    assert clients[tenant].lease(lid, "release", {"exit_code": 0})["ok"]
                    del ends[key]
            for key, tenant, at, cpu, mx, _ in REQUESTS:
                if key not in ids and at <= now:
                    body = lease_body(key, cpu_millis=cpu, memory_mib=MEMORY, max_runtime=mx)
                    ids[key] = (tenant, clients[tenant].request_lease(body)["lease"]["lease_id"])
            cp.scheduler.cycle()
            for key, (tenant, lid) in ids.items():
                if key in started:
                    continue
                lease = clients[tenant].lease(lid, "get")["lease"]
                if lease["state"] == "reserved":
                    assert clients[tenant].lease(lid, "commit", JOB)["ok"]
                    started[key] = (now, lease["node_id"])
                    ends[key] = now + runtime[key]
            step += 1
            assert step < 200, "the scheduler stopped placing"
    finally:
        for c in clients.values():
            c.close()
    return started


def test_the_simulator_places_as_the_scheduler_does(
        plane: tuple[ControlPlane, PoolClient, FakeClock]) -> None:
    assert _scheduled(plane, backfill=False) == _simulated(DRF)


def test_the_simulator_backfills_as_the_scheduler_does(
        plane: tuple[ControlPlane, PoolClient, FakeClock]) -> None:
    simulated = _simulated(DRF_BACKFILL)
    assert simulated != _simulated(DRF)  # the workload is one where backfilling matters
    assert _scheduled(plane, backfill=True) == simulated


def test_the_simulator_decays_past_usage_as_the_scheduler_does(
        plane: tuple[ControlPlane, PoolClient, FakeClock]) -> None:
    decayed = Policy("drf+decay+backfill", backfill=True, half_life_seconds=600)
    simulated = _simulated(decayed)
    assert simulated != _simulated(DRF_BACKFILL)  # the workload is one where the past counts
    assert _scheduled(plane, backfill=True, half_life_seconds=600) == simulated
