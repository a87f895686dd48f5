"""Checkpoint-aware preemption end to end: a real log, the real workers, a fake clock.

Two full 8-core nodes each run one low-priority lease; a high-priority request that needs a
whole node makes the scheduler notice the victim that loses the least work, hold its capacity
through the grace period, and place the request only once the agent confirms the stop.
"""

from __future__ import annotations

from typing import Any

from client.api import PoolClient
from tests.control_plane import (
    Plane,
    lease_body,
    node_body,
    node_report,
    setup_pool,
)
from workers.plane import ControlPlane

WHOLE_NODE = 8000
PREEMPTION = {"enabled": True, "min_runtime_seconds": 0, "grace_seconds": 10}


def _pool(admin: PoolClient, preemption: dict[str, Any] | None = None) -> None:
    tenants = {"alpha": 1.0, "beta": 1.0, "gamma": 1.0}
    if preemption is None:
        setup_pool(admin, tenants=tenants)
    else:
        setup_pool(admin, tenants=tenants, preemption=preemption)
    for n in ("n1", "n2"):
        assert admin.admin("node.register", node_body(n, cpu_millis=WHOLE_NODE))["ok"]


def _running(cp: ControlPlane, tenant: PoolClient, key: str,
             priority: str = "standard") -> tuple[str, str]:
    """Request a whole node, place it and commit it; returns (lease id, node id)."""
    lid = tenant.request_lease(lease_body(key, cpu_millis=WHOLE_NODE, priority=priority)
                               | {"preemptible_requeue": True})["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 1
    committed = tenant.lease(lid, "commit", {})
    assert committed["ok"], committed
    return lid, committed["lease"]["node_id"]


def _state(tenant: PoolClient, lid: str) -> str:
    state: str = tenant.lease(lid, "get")["lease"]["state"]
    return state


def _why(tenant: PoolClient, lid: str) -> dict[str, Any]:
    reasons: dict[str, Any] = tenant.lease(lid, "why")["result"]["reasons"]
    return reasons


def _stopped(url: str, node: str, lid: str, epoch: int = 1) -> dict[str, Any]:
    return node_report(url, node, lid, "stopped", {"epoch": epoch})


def test_a_high_priority_request_preempts_the_lease_that_loses_least_work(plane: Plane) -> None:
    cp, admin, clock = plane
    _pool(admin, PREEMPTION)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        old, _ = _running(cp, a, "no-checkpoint")
        fresh, fresh_node = _running(cp, a, "checkpointed")
        clock.advance(20)
        assert a.lease(old, "heartbeat", {"epoch": 1})["ok"]
        assert a.lease(fresh, "heartbeat", {"epoch": 1, "last_checkpoint_at": clock.now - 2})["ok"]
        high = b.request_lease(lease_body("urgent", cpu_millis=WHOLE_NODE,
                                          priority="high"))["lease"]["lease_id"]
        report = cp.scheduler.cycle()
        assert report.preempted == 1 and report.placed == 0
        assert _state(a, fresh) == "preempting"
        assert _state(a, old) == "running"
        reasons = _why(b, high)
        assert "waiting_for_preemption" in reasons["tenant"]
        assert reasons["preemption"]["victims"] == [fresh]
        assert reasons["preemption"]["node_id"] == fresh_node


def test_a_request_that_cannot_pay_preempts_no_one_and_says_both_reasons(plane: Plane) -> None:
    cp, admin, _clock = plane
    _pool(admin, PREEMPTION)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "gamma") as g:
        running = [_running(cp, a, f"r{i}")[0] for i in range(2)]
        # prices now: a whole node for a day holds ~1.4 * 10**12, past gamma's 10**12
        # (10**6 s is past the pool's default maximum runtime of a day: a day at 2 credits)
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 2_000_000})["ok"]
        poor = g.request_lease(lease_body("urgent-but-poor", cpu_millis=WHOLE_NODE,
                                          priority="high", max_runtime=86_400))["lease"]["lease_id"]
        report = cp.scheduler.cycle()
        assert report.preempted == 0 and report.placed == 0
        assert [_state(a, lid) for lid in running] == ["running", "running"]
        reasons = _why(g, poor)
        assert reasons["tenant"] == ["insufficient_credits"]
        assert reasons["filters"] == {"insufficient_cpu": 2}  # and why no node fits now
        assert reasons["hold_microcredits"] > reasons["available_microcredits"]


def test_a_victim_keeps_its_capacity_through_its_grace_until_the_agent_confirms(plane: Plane) -> None:
    cp, admin, clock = plane
    _pool(admin, PREEMPTION)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        _running(cp, a, "low-1")
        victim, node = _running(cp, a, "low-2")
        clock.advance(20)
        assert a.lease(victim, "heartbeat", {"epoch": 1, "last_checkpoint_at": clock.now})["ok"]
        high = b.request_lease(lease_body("urgent", cpu_millis=WHOLE_NODE,
                                          priority="high"))["lease"]["lease_id"]
        assert cp.scheduler.cycle().preempted == 1
        # within the grace and past it: still held, never noticed twice, the request waits
        for step in (5, 7):
            clock.advance(step)
            report = cp.scheduler.cycle()
            assert report.placed == 0 and report.preempted == 0
            assert _state(a, victim) == "preempting"
            assert _state(b, high) == "queued"
            assert "waiting_for_preemption" in _why(b, high)["tenant"]
        assert _why(b, high)["preemption"]["overdue"] == [victim]
        # only the agent of the victim's own node, at the current epoch, can confirm
        assert _stopped(cp.nats_url, "n-other", victim)["error"]["code"] == "lease_not_found"
        assert _stopped(cp.nats_url, node, victim, epoch=7)["error"]["code"] == "stale_epoch"
        confirmed = _stopped(cp.nats_url, node, victim)
        assert confirmed["ok"], confirmed
        assert confirmed["lease"]["state"] == "queued"  # preempted, then requeued
        assert cp.scheduler.cycle().placed == 1
        placed = b.lease(high, "get")["lease"]
        assert placed["state"] == "reserved" and placed["node_id"] == node
        assert _state(a, victim) == "queued"  # the victim waits its turn again


def test_a_victim_under_its_minimum_runtime_is_not_chosen(plane: Plane) -> None:
    cp, admin, clock = plane
    _pool(admin, {**PREEMPTION, "min_runtime_seconds": 60})
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        seasoned, node = _running(cp, a, "seasoned")
        for _ in range(3):  # keep it alive past the minimum runtime
            clock.advance(20)
            assert a.lease(seasoned, "heartbeat", {"epoch": 1})["ok"]
        young, _ = _running(cp, a, "young")
        clock.advance(5)
        # the young lease loses nothing (fresh checkpoint) but has not run long enough
        assert a.lease(young, "heartbeat", {"epoch": 1, "last_checkpoint_at": clock.now})["ok"]
        high = b.request_lease(lease_body("urgent", cpu_millis=WHOLE_NODE,
                                          priority="high"))["lease"]["lease_id"]
        assert cp.scheduler.cycle().preempted == 1
        assert _state(a, young) == "running"
        assert _state(a, seasoned) == "preempting"
        assert _why(b, high)["preemption"] == {"node_id": node, "victims": [seasoned],
                                               "overdue": []}


def test_same_priority_never_preempts_a_tenant_not_over_its_share(plane: Plane) -> None:
    cp, admin, _clock = plane
    _pool(admin, PREEMPTION)
    with (PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b,
          PoolClient(cp.nats_url, "gamma") as g):
        la, _ = _running(cp, a, "alpha-1")
        lb, _ = _running(cp, b, "beta-1")
        wants = [g.request_lease(lease_body("gamma-1", cpu_millis=WHOLE_NODE))["lease"]["lease_id"],
                 b.request_lease(lease_body("beta-2", cpu_millis=WHOLE_NODE))["lease"]["lease_id"]]
        report = cp.scheduler.cycle()
        assert report.preempted == 0 and report.placed == 0
        assert _state(a, la) == "running" and _state(b, lb) == "running"
        assert "waiting_for_capacity" in _why(g, wants[0])["tenant"]
        assert "waiting_for_capacity" in _why(b, wants[1])["tenant"]


def test_same_priority_preempts_a_tenant_holding_more_than_its_share(plane: Plane) -> None:
    cp, admin, _clock = plane
    _pool(admin, PREEMPTION)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        first, _ = _running(cp, a, "alpha-1")
        second, _ = _running(cp, a, "alpha-2")
        want = b.request_lease(lease_body("beta-1", cpu_millis=WHOLE_NODE))["lease"]["lease_id"]
        assert cp.scheduler.cycle().preempted == 1
        assert sorted([_state(a, first), _state(a, second)]) == ["preempting", "running"]
        assert "waiting_for_preemption" in _why(b, want)["tenant"]


def test_with_preemption_disabled_a_request_just_waits_for_capacity(plane: Plane) -> None:
    cp, admin, clock = plane
    _pool(admin)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        low = [_running(cp, a, f"low-{i}")[0] for i in range(2)]
        clock.advance(20)
        high = b.request_lease(lease_body("urgent", cpu_millis=WHOLE_NODE,
                                          priority="high"))["lease"]["lease_id"]
        report = cp.scheduler.cycle()
        assert report.preempted == 0 and report.placed == 0
        assert [_state(a, lid) for lid in low] == ["running", "running"]
        reasons = _why(b, high)
        assert reasons["tenant"] == ["waiting_for_capacity"]
        assert "preemption" not in reasons


def test_the_stopped_report_settles_a_reconciling_lease_and_frees_its_node(plane: Plane) -> None:
    cp, admin, clock = plane
    _pool(admin)
    with PoolClient(cp.nats_url, "alpha") as a:
        silent, node = _running(cp, a, "silent")
        other, _ = _running(cp, a, "other")
        cp.scheduler.cycle()
        clock.advance(31)  # both stop heartbeating: past the 30 s timeout
        assert cp.scheduler.cycle().expired == 2
        assert _state(a, silent) == "reconciling"
        waiting = a.request_lease(lease_body("next", cpu_millis=WHOLE_NODE))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 0  # reconciling capacity is never recycled
        done = _stopped(cp.nats_url, node, silent)
        assert done["ok"], done
        assert done["lease"]["state"] == "released"
        assert cp.scheduler.cycle().placed == 1
        placed = a.lease(waiting, "get")["lease"]
        assert placed["state"] == "reserved" and placed["node_id"] == node
        assert _state(a, other) == "reconciling"
