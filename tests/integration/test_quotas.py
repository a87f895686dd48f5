"""Quotas and preemption flags against a real log and the real workers, with a fake clock:
partial quotas, non-preemptible tenants and classes, requeue wishes, restarts, runtime limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from control.plane import ControlPlane
from tests.control_plane import (
    FakeClock,
    lease_body,
    node_body,
    node_report,
    setup_pool,
    start,
)

Plane = tuple[ControlPlane, PoolClient, FakeClock]
WHOLE_NODE = 8000
PREEMPTION = {"enabled": True, "min_runtime_seconds": 0, "grace_seconds": 10}
JOB = {"image": "local/job@sha256:" + "a" * 64, "command": ["sleep", "30"],
       "checkpoint_policy": {"mode": "periodic", "interval_seconds": 60}}


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    yield cp, admin, clock
    admin.close()
    cp.stop()


def _nodes(admin: PoolClient, *names: str, cpu_millis: int = WHOLE_NODE) -> None:
    for n in names:
        assert admin.admin("node.register", node_body(n, cpu_millis=cpu_millis))["ok"]


def _running(cp: ControlPlane, tenant: PoolClient, key: str, priority: str = "standard",
             **extra: Any) -> tuple[str, str]:
    """Request a whole node, place it and commit it with a job; (lease id, node id)."""
    lid = tenant.request_lease(lease_body(key, cpu_millis=WHOLE_NODE, priority=priority)
                               | extra)["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 1
    committed = tenant.lease(lid, "commit", {"job": JOB})
    assert committed["ok"], committed
    return lid, committed["lease"]["node_id"]


def _lease(tenant: PoolClient, lid: str) -> dict[str, Any]:
    got: dict[str, Any] = tenant.lease(lid, "get")["lease"]
    return got


def _why(tenant: PoolClient, lid: str) -> dict[str, Any]:
    reasons: dict[str, Any] = tenant.lease(lid, "why")["result"]["reasons"]
    return reasons


def _stopped(url: str, node: str, lid: str, epoch: int = 1) -> dict[str, Any]:
    return node_report(url, node, lid, "stopped", {"epoch": epoch})


# -- defects -------------------------------------------------------------------------------------


def test_a_quota_naming_one_dimension_leaves_the_others_unlimited(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                      "quota": {"cpu_millis": 4000}})["ok"]
    _nodes(admin, "n1")
    with PoolClient(cp.nats_url, "alpha") as a:
        lid = a.request_lease(lease_body("small", cpu_millis=500, memory_mib=64))["lease"]
        assert cp.scheduler.cycle().placed == 1, _why(a, lid["lease_id"])
        assert _lease(a, lid["lease_id"])["state"] == "reserved"


def test_a_quota_still_limits_the_dimension_it_names(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                      "quota": {"cpu_millis": 4000}})["ok"]
    _nodes(admin, "n1")
    with PoolClient(cp.nats_url, "alpha") as a:
        a.request_lease(lease_body("first", cpu_millis=3000))
        second = a.request_lease(lease_body("second", cpu_millis=2000))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 1
        why = _why(a, second)
        assert why["tenant"] == ["quota_exceeded"]
        assert why["quota"] == {"over_limit": ["cpu_millis"]}


def test_a_non_preemptible_tenant_is_never_chosen_as_a_victim(plane: Plane) -> None:
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0, "gamma": 1.0}, preemption=PREEMPTION)
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                      "preemptible": False})["ok"]
    _nodes(admin, "n1", "n2")
    with (PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "gamma") as g,
          PoolClient(cp.nats_url, "beta") as b):
        protected, _ = _running(cp, a, "protected", priority="preemptible")
        exposed, _ = _running(cp, g, "exposed", priority="preemptible")
        clock.advance(20)
        # the protected lease would lose nothing (a fresh checkpoint): still not chosen
        assert a.lease(protected, "heartbeat", {"epoch": 1, "last_checkpoint_at": clock.now})["ok"]
        high = b.request_lease(lease_body("urgent", cpu_millis=WHOLE_NODE, priority="high"))
        assert cp.scheduler.cycle().preempted == 1
        assert _lease(a, protected)["state"] == "running"
        assert _lease(g, exposed)["state"] == "preempting"
        assert _why(b, high["lease"]["lease_id"])["preemption"]["victims"] == [exposed]


def test_a_non_preemptible_priority_class_is_never_chosen_as_a_victim(plane: Plane) -> None:
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, preemption=PREEMPTION,
               non_preemptible_classes=["standard"])
    _nodes(admin, "n1")
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        lid, _ = _running(cp, a, "standard-work")
        clock.advance(20)
        high = b.request_lease(lease_body("urgent", cpu_millis=WHOLE_NODE, priority="high"))
        report = cp.scheduler.cycle()
        assert report.preempted == 0 and report.placed == 0
        assert _lease(a, lid)["state"] == "running"
        assert _why(b, high["lease"]["lease_id"])["tenant"] == ["waiting_for_capacity"]


def test_a_class_that_is_not_defined_cannot_be_non_preemptible(plane: Plane) -> None:
    _cp, admin, _clock = plane
    r = admin.admin("pool.set", {"pool_id": "p1", "priority_classes": {"standard": 0},
                                 "non_preemptible_classes": ["gold"]})
    assert r["error"]["code"] == "invalid_configuration"


def _preempt_one(cp: ControlPlane, admin: PoolClient, clock: FakeClock, *,
                 requeue: bool) -> tuple[PoolClient, PoolClient, str, str, str]:
    """alpha's lease (with or without a requeue wish) preempted by beta's high request and
    confirmed stopped; returns (alpha, beta, victim, node, the high request)."""
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, preemption=PREEMPTION)
    _nodes(admin, "n1")
    a, b = PoolClient(cp.nats_url, "alpha"), PoolClient(cp.nats_url, "beta")
    victim, node = _running(cp, a, "victim", priority="preemptible",
                            preemptible_requeue=requeue, checkpointable=True)
    clock.advance(20)
    assert a.lease(victim, "heartbeat", {"epoch": 1, "last_checkpoint_at": clock.now - 5})["ok"]
    high = b.request_lease(lease_body("urgent", cpu_millis=WHOLE_NODE, priority="high",
                                      max_runtime=60))["lease"]["lease_id"]
    assert cp.scheduler.cycle().preempted == 1
    assert _stopped(cp.nats_url, node, victim)["ok"]
    return a, b, victim, node, high


def test_a_preempted_lease_that_did_not_ask_for_requeue_ends_as_preempted(plane: Plane) -> None:
    cp, admin, clock = plane
    a, b, victim, _node, high = _preempt_one(cp, admin, clock, requeue=False)
    try:
        lease = _lease(a, victim)
        assert lease["state"] == "preempted" and lease["end_reason"] == "preempted"
        assert cp.scheduler.cycle().placed == 1
        assert _lease(b, high)["state"] == "reserved"
    finally:
        a.close()
        b.close()


def test_a_requeued_lease_restarts_its_job_on_its_own_when_placed_again(plane: Plane) -> None:
    cp, admin, clock = plane
    a, b, victim, node, high = _preempt_one(cp, admin, clock, requeue=True)
    try:
        assert _lease(a, victim)["state"] == "queued"
        assert cp.scheduler.cycle().placed == 1  # the high request takes the node
        assert b.lease(high, "commit", {})["ok"]
        assert b.lease(high, "release", {})["ok"]
        assert cp.scheduler.cycle().placed == 1  # the victim comes back
        lease = _lease(a, victim)
        # running at once, its interrupted job restarted (attempt 2), no commit asked for
        assert lease["state"] == "running" and lease["epoch"] == 2, lease
        assert lease["node_id"] == node
        job = cp.app.get("alpha", victim).job
        assert job is not None and job.attempts == 2 and job.spec.image == JOB["image"]
        assert job.spec.checkpoint_interval_seconds == 60
        assert cp.app.get("alpha", victim).last_checkpoint_at == clock.now - 5  # kept
    finally:
        a.close()
        b.close()


def test_a_requeued_job_the_image_policy_now_refuses_waits_reserved(plane: Plane) -> None:
    cp, admin, clock = plane
    a, b, victim, _node, high = _preempt_one(cp, admin, clock, requeue=True)
    try:
        assert cp.scheduler.cycle().placed == 1
        assert b.lease(high, "commit", {})["ok"] and b.lease(high, "release", {})["ok"]
        # the registry of the job's image is no longer approved
        assert admin.admin("pool.images", {"pool_id": "p1",
                                           "approved_registries": ["registry.example"]})["ok"]
        assert cp.scheduler.cycle().placed == 1
        assert _lease(a, victim)["state"] == "reserved"  # the tenant commits a new job, or not
    finally:
        a.close()
        b.close()


def test_a_request_past_the_pools_maximum_runtime_is_refused_naming_the_limit(
        plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, maximum_runtime_seconds=3600)
    with PoolClient(cp.nats_url, "alpha") as a:
        r = a.request_lease(lease_body("long", max_runtime=3601))
        assert r["error"]["code"] == "maximum_runtime_exceeded"
        assert "3600 s (1 h)" in r["error"]["message"]
        assert a.request_lease(lease_body("fits", max_runtime=3600))["ok"]
    shown = admin.admin("pool.show", {"pool_id": "p1"})["result"]["config"]
    assert shown["maximum_runtime_seconds"] == 3600
