"""Quotas and preemption flags against a real log and the real workers, with a fake clock:
partial quotas, non-preemptible tenants and classes, requeue wishes, restarts, runtime limits."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from client.api import PoolClient
from projections.decisions import check_quotas
from tests.control_plane import (
    FakeClock,
    Plane,
    lease_body,
    node_body,
    node_report,
    setup_pool,
)
from workers.plane import ControlPlane

WHOLE_NODE = 8000
PREEMPTION = {"enabled": True, "min_runtime_seconds": 0, "grace_seconds": 10}
JOB = {"image": "local/job@sha256:" + "a" * 64, "command": ["sleep", "30"],
       "checkpoint_policy": {"mode": "periodic", "interval_seconds": 60}}


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
                                      "preemptible": False,
                                      "priority_classes": ["preemptible"]})["ok"]
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


# -- cohorts -------------------------------------------------------------------------------------


def _cohort(admin: PoolClient, *, alpha: dict[str, Any] | None = None,
            beta: dict[str, Any] | None = None, reclaim: str = "any") -> None:
    """Cohort "research" of alpha and beta, each with a nominal whole node of CPU."""
    assert admin.admin("cohort.set", {"pool_id": "p1", "name": "research",
                                      "reclaim": reclaim})["ok"]
    for tenant, extra in (("alpha", alpha or {}), ("beta", beta or {})):
        r = admin.admin("tenant.set", {"tenant": tenant, "pool_id": "p1", "cohort": "research",
                                       "nominal": {"cpu_millis": WHOLE_NODE}, **extra})
        assert r["ok"], r


def test_a_tenant_borrows_up_to_its_borrow_limit_and_never_past_it(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    _cohort(admin, alpha={"borrow_limit": {"cpu_millis": 4000}})
    _nodes(admin, "n1", "n2", "n3")
    with PoolClient(cp.nats_url, "alpha") as a:
        lids = [a.request_lease(lease_body(f"a{i}", cpu_millis=4000))["lease"]["lease_id"]
                for i in range(4)]
        assert cp.scheduler.cycle().placed == 3  # 8000 nominal + 4000 borrowed
        waiting = [lid for lid in lids if _lease(a, lid)["state"] == "queued"]
        assert len(waiting) == 1
        why = _why(a, waiting[0])
        assert why["tenant"] == ["quota_exceeded"]
        assert why["quota"] == {"over_limit": ["cpu_millis"]}
        assert cp.scheduler.cycle().placed == 0  # the third node stays free for beta
    replay = check_quotas(cp.app)
    assert replay.placements == 3 and replay.breaches == []


def test_a_lend_limit_keeps_part_of_an_owners_quota_from_borrowers(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    _cohort(admin, beta={"lend_limit": {"cpu_millis": 2000}})
    _nodes(admin, "n1", "n2", "n3")
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        for i in range(6):
            a.request_lease(lease_body(f"a{i}", cpu_millis=2000))
        assert cp.scheduler.cycle().placed == 5  # its own 8000 and the 2000 beta lends
        owner = b.request_lease(lease_body("b0", cpu_millis=6000))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 1  # beta's kept 6000 is beta's at once
        assert _lease(b, owner)["state"] == "reserved"


def test_an_owner_reclaims_lent_quota_by_preempting_a_borrower_with_grace(plane: Plane) -> None:
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, preemption=PREEMPTION)
    _cohort(admin)
    _nodes(admin, "n1", "n2")
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        old, _ = _running(cp, a, "old")
        fresh, node = _running(cp, a, "fresh", checkpointable=True)  # borrows beta's nominal
        clock.advance(30)
        assert a.lease(old, "heartbeat", {"epoch": 1})["ok"]
        assert a.lease(fresh, "heartbeat", {"epoch": 1, "last_checkpoint_at": clock.now})["ok"]
        mine = b.request_lease(lease_body("mine", cpu_millis=WHOLE_NODE))["lease"]["lease_id"]
        report = cp.scheduler.cycle()
        assert report.preempted == 1 and report.placed == 0
        # the borrower's lease that loses least work goes, with the pool's grace
        victim = _lease(a, fresh)
        assert victim["state"] == "preempting" and _lease(a, old)["state"] == "running"
        assert cp.app.get("alpha", fresh).stop_reason == "reclaiming_quota"
        why = _why(b, mine)
        assert why["tenant"] == ["quota_exceeded", "waiting_for_reclaim"]
        assert why["quota"]["borrowed_by"] == {"alpha": {"cpu_millis": WHOLE_NODE}}
        assert why["reclaim"] == {"victims": [fresh]}
        # within the grace: nothing more is preempted, the owner keeps waiting
        clock.advance(5)
        report = cp.scheduler.cycle()
        assert report.preempted == 0 and report.placed == 0
        assert _lease(a, old)["state"] == "running"
        assert _stopped(cp.nats_url, node, fresh)["ok"]
        assert cp.scheduler.cycle().placed == 1
        assert _lease(b, mine)["state"] == "reserved"
        assert _lease(a, fresh)["end_reason"] == "preempted"
        assert cp.app.get("alpha", fresh).stop_reason == "reclaiming_quota"  # and why
    replay = check_quotas(cp.app)
    assert replay.placements == 3 and replay.breaches == []


def test_the_replay_check_finds_a_placement_past_the_quota(plane: Plane,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    _cohort(admin, alpha={"borrow_limit": {"cpu_millis": 0}})
    _nodes(admin, "n1", "n2")
    monkeypatch.setattr("workers.scheduler.placing.quota_wait", lambda *a, **kw: None)  # a broken gate
    with PoolClient(cp.nats_url, "alpha") as a:
        for i in range(2):
            a.request_lease(lease_body(f"a{i}", cpu_millis=WHOLE_NODE))
        assert cp.scheduler.cycle().placed == 2
    replay = check_quotas(cp.app)
    assert replay.placements == 2 and len(replay.breaches) == 1
    assert replay.breaches[0].startswith("tenant alpha holds 16000 cpu_millis, past its limit 8000")


def test_an_owner_in_a_cohort_that_never_reclaims_waits_naming_the_borrower(
        plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, preemption=PREEMPTION)
    _cohort(admin, reclaim="never")
    _nodes(admin, "n1", "n2")
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        _running(cp, a, "one")
        _running(cp, a, "two")
        mine = b.request_lease(lease_body("mine", cpu_millis=WHOLE_NODE))["lease"]["lease_id"]
        assert cp.scheduler.cycle().preempted == 0
        why = _why(b, mine)
        assert why["tenant"] == ["quota_exceeded"]
        assert why["quota"] == {"cohort_full": ["cpu_millis"],
                                "borrowed_by": {"alpha": {"cpu_millis": WHOLE_NODE}}}


def test_quota_and_credits_both_named_when_both_hold_a_request_back(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, credits=1)
    assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 1_000_000})["ok"]
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                      "quota": {"cpu_millis": 500}})["ok"]
    _nodes(admin, "n1")
    with PoolClient(cp.nats_url, "alpha") as a:
        lid = a.request_lease(lease_body("both", cpu_millis=1000))["lease"]["lease_id"]
        cp.scheduler.cycle()
        why = _why(a, lid)
        assert why["tenant"] == ["quota_exceeded", "insufficient_credits"]
        assert why["hold_microcredits"] > why["available_microcredits"]


def test_a_tenant_cannot_join_a_cohort_that_was_never_set(plane: Plane) -> None:
    _cp, admin, _clock = plane
    setup_pool(admin)
    r = admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1", "cohort": "nowhere",
                                   "nominal": {"cpu_millis": 1}})
    assert r["error"]["code"] == "unknown_cohort"


def test_pool_show_prints_every_limit_in_force(plane: Plane) -> None:
    _cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 2.0})
    assert admin.admin("cohort.set", {"pool_id": "p1", "name": "research",
                                      "nominal": {"gpu_count": 2}})["ok"]
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1", "cohort": "research",
                                      "nominal": {"cpu_millis": 8000},
                                      "borrow_limit": {"cpu_millis": 4000},
                                      "lend_limit": {"cpu_millis": 1000},
                                      "preemptible": False})["ok"]
    quotas = admin.admin("pool.show", {"pool_id": "p1"})["result"]["quotas"]
    assert quotas["cohorts"] == {"research": {"nominal": {"gpu_count": 2}, "reclaim": "any",
                                              "members": ["alpha"]}}
    assert quotas["tenants"]["alpha"] == {
        "nominal": {"cpu_millis": 8000}, "borrow_limit": {"cpu_millis": 4000},
        "lend_limit": {"cpu_millis": 1000}, "cohort": "research", "preemptible": False,
        "weight": 1.0, "priority_classes": ["standard"]}
    assert quotas["tenants"]["beta"]["nominal"] is None and quotas["tenants"]["beta"]["weight"] == 2.0


# -- fair share that remembers -------------------------------------------------------------------


def _night_then_morning(cp: ControlPlane, admin: PoolClient, clock: FakeClock,
                        half_life: int) -> tuple[str, str]:
    """alpha holds the one node all night and lets go; in the morning alpha asks first, then
    beta; one node, so one of them is placed. Returns (alpha's, beta's) morning lease ids."""
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0},
               fair_share_half_life_seconds=half_life, default_lease_seconds=86_400,
               heartbeat_timeout_seconds=86_400)
    _nodes(admin, "n1")
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        night = a.request_lease(lease_body("night", cpu_millis=WHOLE_NODE,
                                           max_runtime=86_400))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 1
        assert a.lease(night, "commit", {})["ok"]
        clock.advance(8 * 3600)  # all night (a day's term, a day's heartbeat timeout)
        assert a.lease(night, "release", {})["ok"]
        clock.advance(1800)
        early = a.request_lease(lease_body("morning-a", cpu_millis=WHOLE_NODE))
        clock.advance(1)
        late = b.request_lease(lease_body("morning-b", cpu_millis=WHOLE_NODE))
        assert cp.scheduler.cycle().placed == 1
        return early["lease"]["lease_id"], late["lease"]["lease_id"]


def test_with_a_half_life_the_tenant_that_used_nothing_goes_first(plane: Plane) -> None:
    cp, admin, clock = plane
    alpha, beta = _night_then_morning(cp, admin, clock, half_life=4 * 3600)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        assert _lease(b, beta)["state"] == "reserved"
        assert _lease(a, alpha)["state"] == "queued"
    # asked of the running scheduler (`pool shares`), which reads them at its clock's now
    got = admin.call("pool.ops.pool.shares", {"pool_id": "p1"})
    assert got["ok"], got
    shares = got["result"]
    assert shares["at"] == clock.now and shares["half_life_seconds"] == 4 * 3600
    rows = {r["tenant"]: r for r in shares["tenants"]}
    assert rows["beta"]["current_share"] == 1.0 and rows["alpha"]["current_share"] == 0.0
    # alpha's night, at half an hour and a bit after, decayed: 8 h of 8000 milli-cores
    tau = 4 * 3600 / math.log(2)
    expected = WHOLE_NODE * tau * (1 - 2 ** -2) * 2 ** (-1801 / (4 * 3600))
    assert rows["alpha"]["decayed_usage"]["cpu_millis"] == pytest.approx(expected, rel=1e-6)
    assert rows["beta"]["decayed_usage"].get("cpu_millis", 0.0) == pytest.approx(0.0, abs=1e-6)
    assert rows["alpha"]["weight"] == 1.0 and {r["rank"] for r in rows.values()} == {1, 2}


def test_without_a_half_life_the_morning_is_first_come_first_served(plane: Plane) -> None:
    cp, admin, clock = plane
    alpha, beta = _night_then_morning(cp, admin, clock, half_life=0)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        assert _lease(a, alpha)["state"] == "reserved"
        assert _lease(b, beta)["state"] == "queued"


def test_pool_audit_decisions_names_a_placement_past_the_quota(
        plane: Plane, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    _cohort(admin, alpha={"borrow_limit": {"cpu_millis": 0}})
    _nodes(admin, "n1", "n2")
    args = ["--nats-url", cp.nats_url]
    with PoolClient(cp.nats_url, "alpha") as a:
        a.request_lease(lease_body("a0", cpu_millis=WHOLE_NODE))
        assert cp.scheduler.cycle().placed == 1
        assert main(["audit", "decisions", *args]) == 0  # within its quota: sound
        assert "decisions ok" in capsys.readouterr().out
        monkeypatch.setattr("workers.scheduler.placing.quota_wait",
                            lambda *a, **kw: None)  # a broken gate
        a.request_lease(lease_body("a1", cpu_millis=WHOLE_NODE))
        assert cp.scheduler.cycle().placed == 1
    assert main(["audit", "decisions", "--json", *args]) == 1
    found = json.loads(capsys.readouterr().out)
    assert not found["ok"] and found["violations"]["placements"] == []
    assert found["violations"]["quotas"][0].startswith(
        "tenant alpha holds 16000 cpu_millis, past its limit 8000")
