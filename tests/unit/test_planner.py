"""The scheduler's planner alone: a fold built in memory from domain events (no log, no bus,
no clock), one call to `plan`, and assertions on the plans it returns."""

from __future__ import annotations

from typing import Any

import pytest

from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.policy import reasons as R
from domain.pool import Pool, TenantPolicy
from domain.poolconfig import PoolConfig
from domain.resources import NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId
from workers.scheduler import Plan, Planner, SchedulerFold

NOW = 1_000_000.0


def _fold(*aggregates: Any) -> SchedulerFold:
    """A scheduler's fold fed these aggregates' events, as catch-up would from the log."""
    fold = SchedulerFold()
    for agg in aggregates:
        for event in agg.collect_events():
            fold.apply(event)
    return fold


def _pool(*, nodes: int, cpu_millis: int = 4000) -> list[Any]:
    cfg = PoolConfig(priority_classes=(("standard", 10),), default_priority_class="standard")
    out: list[Any] = [Pool.create(pool_id=PoolId("p"), now=NOW, config=cfg)]
    for tenant in ("alpha", "beta"):
        out.append(TenantPolicy.set(pool_id=PoolId("p"), tenant_id=TenantId(tenant), now=NOW))
    caps = NodeCapabilities(allocatable=Resources(cpu_millis=cpu_millis, memory_mib=8192))
    out += [Node.register(node_id=NodeId(f"n{i}"), pool_id=PoolId("p"), capabilities=caps,
                          now=NOW) for i in range(nodes)]
    return out


def _lease(tenant: str, key: str, cpu_millis: int, at: float = NOW) -> Lease:
    return Lease.request(tenant_id=TenantId(tenant), pool_id=PoolId("p"), idempotency_key=key,
                         shape=Shape.build(cpu_millis=cpu_millis, memory_mib=1024),
                         maximum_runtime_seconds=3600, now=at, priority_class="standard",
                         queued=True)


def test_a_plan_reserves_what_fits_rejects_what_never_can_and_says_why_the_rest_waits() -> None:
    small = [_lease("alpha", f"a{i}", 3000, NOW - 10 + i) for i in range(3)]
    huge = _lease("beta", "huge", 64000)
    fold = _fold(*_pool(nodes=2), *small, huge)
    planned = Planner().plan(fold, fold.pools["p"], NOW + 1)
    plans = list(planned)
    assert len(plans) == 1 and isinstance(plans[0], Plan)
    plan = plans[0]
    # one 3-core lease per 4-core node, the oldest two, each with its node and no devices
    ids = [str(x.id) for x in small]
    assert sorted(plan.reservations()) == sorted(
        [(ids[0], "n0", ()), (ids[1], "n1", ())]) or sorted(plan.reservations()) == sorted(
        [(ids[0], "n1", ()), (ids[1], "n0", ())])
    assert {node for node in plan.allocations} == {"n0", "n1"}
    assert plan.rejected == [str(huge.id)]
    assert plan.reasons[str(huge.id)]["never_satisfiable"] is True
    # the third waits for capacity, first in line
    assert planned.waiting == 1
    assert R.WAITING_FOR_CAPACITY in plan.reasons[ids[2]]["tenant"]
    assert fold.reasons[ids[2]]["queue"]["position"] == 1
    # the decisions are the leases' own events, not yet saved by anyone
    states = {str(a.id): a.state for a in plan.aggregates if isinstance(a, Lease)}
    assert states == {ids[0]: LeaseState.RESERVED, ids[1]: LeaseState.RESERVED,
                      str(huge.id): LeaseState.REJECTED}
    assert plan.messages == 3 + 2  # three lease events, one allocation event per node


def test_the_next_plan_sees_the_last_ones_placements_without_a_save() -> None:
    fold = _fold(*_pool(nodes=1), _lease("alpha", "a0", 3000))
    planner = Planner()
    (first,) = list(planner.plan(fold, fold.pools["p"], NOW + 1))
    assert len(first.reserved) == 1
    for event in _lease("beta", "b0", 3000).collect_events():
        fold.apply(event)
    again = planner.plan(fold, fold.pools["p"], NOW + 2)
    (second,) = list(again)
    assert second.reserved == [] and again.waiting == 1  # the node's 4 cores hold 3 already


def test_a_fair_planner_gives_the_next_node_to_the_tenant_with_less() -> None:
    # alpha asked first, twice; beta once: with one free node left after alpha's first, the
    # weighted DRF order hands it to beta
    leases = [_lease("alpha", "a0", 4000, NOW - 3), _lease("alpha", "a1", 4000, NOW - 2),
              _lease("beta", "b0", 4000, NOW - 1)]
    fold = _fold(*_pool(nodes=2), *leases)
    (plan,) = list(Planner().plan(fold, fold.pools["p"], NOW))
    assert {lease.tenant_id for lease in plan.reserved} == {"alpha", "beta"}


def test_a_pass_yields_a_plan_each_time_one_fills_a_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.scheduler import placing

    monkeypatch.setattr(placing, "MAX_MESSAGES_PER_BATCH", 6)
    leases = [_lease("alpha", f"a{i}", 1000, NOW - 20 + i) for i in range(12)]
    fold = _fold(*_pool(nodes=4), *leases)
    planned = Planner().plan(fold, fold.pools["p"], NOW)
    plans = list(planned)
    # each but the last closed by the placement that reached the limit (its lease, node and
    # account events at most past it), as a batch is under JetStream's
    assert len(plans) > 2 and all(6 <= p.messages < 6 + 3 for p in plans[:-1])
    assert plans[-1].messages < 6 + 3
    placed = [str(lease.id) for p in plans for lease in p.reserved]
    assert sorted(placed) == sorted(str(x.id) for x in leases)  # each once, none lost
    assert planned.waiting == 0
    # each plan records its own nodes' placements: none is in two plans
    for p in plans:
        assert sum(len(v) for v in p.allocations.values()) == len(p.reserved)
