"""The simulator places through the live scheduler's planner: one small workload driven here
cycle by cycle as the live scheduler drives its planner (the planner's own settings, start
estimates included; each plan's node allocations recorded as the batch writer records them;
commits and releases arriving as events that the fold applies, as catch-up would) starts
every request at the same time on the same node as the simulator does."""

from __future__ import annotations

import copy
import heapq
from typing import Any
from uuid import UUID

import pytest

from domain.lease import Lease
from domain.node import Node
from domain.pool import Pool
from domain.poolconfig import PoolConfig
from domain.resources import NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId
from sim import DRF, DRF_BACKFILL, FIFO, Policy, SimNode, SimRequest, Simulator, Tenant, Workload
from workers.scheduler import Planner, SchedulerFold
from workers.scheduler.state import node_uuid

STEP = 60.0
CLASSES = (("preemptible", 0), ("standard", 10), ("high", 20))
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
CONFIG = PoolConfig(priority_classes=CLASSES, default_priority_class="standard",
                    maximum_runtime_seconds=86_400)


def _workload() -> Workload:
    nodes = tuple(SimNode(n, NodeCapabilities(allocatable=Resources(cpu, 32768, 0, 100)))
                  for n, cpu in NODES)
    reqs = tuple(SimRequest(k, t, float(at), Shape.build(cpu_millis=cpu, memory_mib=1024),
                            float(ran), mx, priority_class="standard")
                 for k, t, at, cpu, mx, ran in REQUESTS)
    return Workload(nodes, tuple(Tenant(t, "", w) for t, w in TENANTS.items()), reqs, 700.0)


def _simulated(policy: Policy) -> dict[str, tuple[float, str]]:
    result = Simulator(_workload(), policy, config=CONFIG, cycle_seconds=STEP).run()
    out = {}
    for o in result.outcomes:
        assert o.started_at is not None and o.node_id is not None
        out[o.request.request_id] = (o.started_at, o.node_id)
    return out


def _feed(fold: SchedulerFold, agg: Any) -> None:
    for event in agg.collect_events():
        fold.apply(event)


def _elsewhere(fold: SchedulerFold, oid: UUID) -> Any:
    """The aggregate as another process loads it (a client committing, an agent releasing):
    a copy, whose new events the fold then applies, as catch-up would."""
    return copy.deepcopy(fold.aggregates.get(oid))


def _planned(backfill: bool, half_life_seconds: int = 0) -> dict[str, tuple[float, str]]:
    """The live planner over a fold fed the workload's events, cycle by cycle."""
    fold = SchedulerFold()
    cfg = CONFIG if not half_life_seconds else PoolConfig(
        priority_classes=CLASSES, default_priority_class="standard",
        maximum_runtime_seconds=86_400, fair_share_half_life_seconds=half_life_seconds)
    _feed(fold, Pool.create(pool_id=PoolId("p"), now=0.0, config=cfg))
    for node_id, cpu in NODES:
        _feed(fold, Node.register(
            node_id=NodeId(node_id), pool_id=PoolId("p"), now=0.0,
            capabilities=NodeCapabilities(allocatable=Resources(cpu, 32768, 0, 100))))
    ps = fold.pools["p"]
    assert ps.queue is not None
    for tenant, weight in TENANTS.items():
        ps.weights[tenant] = weight
        ps.queue.set_weight(tenant, weight)
    planner = Planner(backfill=backfill)  # as the live scheduler has it: estimates on
    key_of: dict[str, str] = {}
    runtime = {k: float(ran) for k, *_, ran in REQUESTS}
    started: dict[str, tuple[float, str]] = {}
    ends: list[tuple[float, str]] = []
    arrived: set[str] = set()
    step = 0
    while len(started) < len(REQUESTS):
        now = step * STEP
        while ends and ends[0][0] <= now:
            _, lid = heapq.heappop(ends)
            lease = _elsewhere(fold, UUID(lid))
            lease.release(now)
            _feed(fold, lease)
            node = _elsewhere(fold, node_uuid(str(lease.node_id)))
            node.free(lid, now)
            _feed(fold, node)
        for key, tenant, at, cpu, mx, _ in REQUESTS:
            if key not in arrived and at <= now:
                arrived.add(key)
                lease = Lease.request(
                    tenant_id=TenantId(tenant), pool_id=PoolId("p"), idempotency_key=key,
                    shape=Shape.build(cpu_millis=cpu, memory_mib=1024),
                    maximum_runtime_seconds=mx, now=float(at), lease_seconds=mx,
                    priority_class="standard")
                lease.queue(float(at))
                key_of[str(lease.id)] = key
                _feed(fold, lease)
        planner.begin_cycle()
        placed: list[str] = []
        for plan in planner.plan(fold, ps, now):
            for agg in plan.aggregates:  # saved: the log holds them, the fold has them
                agg.collect_events()
            for node_id, allocations in plan.allocations.items():  # the writer's node events
                node = fold.aggregates[node_uuid(node_id)]
                node.allocate_many(allocations, now)
                node.collect_events()
            placed += [str(lease.id) for lease in plan.reserved]
        for lid in placed:  # each committed by its client once the cycle's batch is out
            lease = _elsewhere(fold, UUID(lid))
            lease.commit(now)
            _feed(fold, lease)
            started[key_of[lid]] = (now, str(lease.node_id))
            heapq.heappush(ends, (now + runtime[key_of[lid]], lid))
        step += 1
        assert step < 200, "the planner stopped placing"
    return started


@pytest.mark.parametrize("policy", [DRF, DRF_BACKFILL], ids=lambda p: p.name)
def test_the_simulator_places_as_the_live_planner_does(policy: Policy) -> None:
    assert _simulated(policy) == _planned(backfill=policy.backfill)


def test_the_workload_is_one_where_the_policies_differ() -> None:
    # so the comparisons above would see a simulator that ignored fairness or backfill
    assert _simulated(DRF) != _simulated(DRF_BACKFILL)
    assert _simulated(DRF) != _simulated(FIFO)


def test_the_simulator_decays_past_usage_as_the_live_planner_does() -> None:
    decayed = Policy("drf+decay+backfill", backfill=True, half_life_seconds=600)
    assert _simulated(decayed) != _simulated(DRF_BACKFILL)
    assert _simulated(decayed) == _planned(backfill=True, half_life_seconds=600)
