"""No tenant degrades the others, against a real plane on a real server (issue 40): a flood of
one tenant's heartbeats and renewals costs the log nothing, its queue has a cap, and it uses only
the priority classes the operator granted it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import nats
import pytest

from bus.local.server import NatsServer
from bus.subjects import EVENTS_PREFIX, EVENTS_STREAM
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.application import queue_book
from workers.plane import ControlPlane

Plane = tuple[ControlPlane, PoolClient, PoolClient, FakeClock]
FLOOD = 500
QUEUE_CAP = 5
JOB = {"image": "busybox@sha256:" + "a" * 64, "command": ["sleep", "1d"]}


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    # a term shorter than the maximum runtime, so renewals have room to move the deadline
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, default_lease_seconds=600,
               heartbeat_timeout_seconds=30, renew_step_seconds=60,
               max_queued_leases=QUEUE_CAP)
    for node in ("n1", "n2"):
        assert admin.admin("node.register", node_body(node))["ok"]
    yield cp, admin, alpha, clock
    alpha.close()
    admin.close()
    cp.stop()


def _events_per_lease(url: str, lease_ids: list[str]) -> dict[str, int]:
    """How many messages the log's stream holds on each lease's subject."""
    async def go() -> dict[str, int]:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().stream_info(EVENTS_STREAM,
                                                    subjects_filter=f"{EVENTS_PREFIX}.>")
            subjects = info.state.subjects or {}
        finally:
            await nc.close()
        return {lid: sum(n for s, n in subjects.items() if s.endswith("." + lid))
                for lid in lease_ids}

    return asyncio.run(go())


def _running(cp: ControlPlane, alpha: PoolClient, body: dict[str, object]) -> list[str]:
    r = alpha.request_lease(body)
    assert r["ok"], r
    ids: list[str] = r["result"]["lease_ids"] if "group" in body else [r["lease"]["lease_id"]]
    assert cp.scheduler.cycle().placed == len(ids)
    assert alpha.lease(ids[0], "commit", {"job": JOB})["ok"]
    return ids


def test_a_flood_of_heartbeats_and_renewals_appends_only_real_changes(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, _admin, alpha, clock = plane
    (lid,) = _running(cp, alpha, lease_body("flooded", max_runtime=86_400))
    before = _events_per_lease(fresh_nats.url, [lid])[lid]
    deadline = alpha.lease(lid, "get")["lease"]["deadline"]
    # FLOOD of each within 5 s: under a quarter of the heartbeat timeout, and no renewal
    # moves the deadline by the pool's 60 s step
    deadlines = set()
    for _ in range(FLOOD):
        clock.advance(0.01)
        beat = alpha.lease(lid, "heartbeat", {"epoch": 1})
        assert beat["ok"], beat
        renewed = alpha.lease(lid, "renew", {})
        assert renewed["ok"], renewed
        deadlines.add(renewed["lease"]["deadline"])
    # the first heartbeat of the placement is news; nothing else was
    assert _events_per_lease(fresh_nats.url, [lid])[lid] == before + 1
    assert deadlines == {deadline}
    # real changes still land: a heartbeat a quarter timeout on, a renewal that moves a step
    clock.advance(60)
    assert alpha.lease(lid, "heartbeat", {"epoch": 1})["ok"]
    renewed = alpha.lease(lid, "renew", {})
    assert renewed["ok"] and renewed["lease"]["deadline"] == clock() + 600
    assert _events_per_lease(fresh_nats.url, [lid])[lid] == before + 3


def test_a_flood_of_heartbeats_on_a_gang_member_appends_nothing_per_member(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, _admin, alpha, clock = plane
    ids = _running(cp, alpha, lease_body("gang") | {"group": {"members": 2}})
    before = _events_per_lease(fresh_nats.url, ids)
    for _ in range(FLOOD):
        clock.advance(0.01)
        beat = alpha.lease(ids[1], "heartbeat", {"epoch": 1})
        assert beat["ok"], beat
    after = _events_per_lease(fresh_nats.url, ids)
    assert after == {lid: before[lid] + 1 for lid in ids}, (before, after)


def test_a_tenant_cannot_queue_past_its_pools_cap_and_another_tenant_still_can(
        fresh_nats: NatsServer, plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    cp, _admin, alpha, _clock = plane
    monkeypatch.setattr(queue_book, "RECOUNT_SECONDS", 0.0)  # every request may count again
    assert alpha.request_lease(lease_body("three") | {"count": 3})["ok"]
    assert alpha.request_lease(lease_body("two") | {"count": 2})["ok"]
    stored = cp.app.recorder.max_notification_id()
    over = alpha.request_lease(lease_body("sixth"))
    assert not over["ok"] and over["error"]["code"] == "queue_limit_exceeded", over
    assert "max_queued_leases" in over["error"]["reasons"]  # the limit, named
    assert "max_queued_leases is 5: 0 more may queue" in over["error"]["message"]
    flood = [alpha.request_lease(lease_body(f"flood-{i}")) for i in range(50)]
    assert {r["error"]["code"] for r in flood if not r["ok"]} == {"queue_limit_exceeded"}
    assert not any(r["ok"] for r in flood)
    assert cp.app.recorder.max_notification_id() == stored  # refusals append nothing
    # a retry of a request already made is answered with what it made, at the cap too
    assert alpha.request_lease(lease_body("two") | {"count": 2})["ok"]
    with PoolClient(fresh_nats.url, "beta") as beta:  # the cap is per tenant
        assert beta.request_lease(lease_body("beta-1"))["ok"]
    # placed leases wait no more: room again, and a count past what is left is refused whole
    assert cp.scheduler.cycle().placed == 6
    assert alpha.request_lease(lease_body("four") | {"count": 4})["ok"]
    two = alpha.request_lease(lease_body("two-more") | {"count": 2})
    assert not two["ok"] and two["error"]["code"] == "queue_limit_exceeded", two
    assert "4 leases queued" in two["error"]["message"]
    assert "1 more may queue, this request asks for 2" in two["error"]["message"]
    assert alpha.request_lease(lease_body("last"))["ok"]


def _until_ok(request: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """`request(n)` again until it is answered ok or two seconds pass (a policy change reaches
    the command service's cache when the log stores it)."""
    deadline = time.monotonic() + 2.0
    n = 0
    while True:
        n += 1
        r = request(n)
        if r["ok"] or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


def test_a_tenant_may_request_only_the_priority_classes_the_operator_granted(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, admin, _alpha, _clock = plane
    assert admin.admin("tenant.set", {"tenant": "gamma", "pool_id": "p1"})["ok"]
    stored = cp.app.recorder.max_notification_id()
    # gamma was set without grants, delta never: both may use the pool's default class only
    with PoolClient(fresh_nats.url, "gamma") as gamma, PoolClient(fresh_nats.url, "delta") as delta:
        for who in (gamma, delta):
            for cls in ("high", "preemptible"):  # jump the queue; be a cheap victim's peer
                r = who.request_lease(lease_body(f"{cls}-0", priority=cls))
                assert not r["ok"] and r["error"]["code"] == "priority_class_not_allowed", r
                assert set(r["error"]["reasons"]) == {cls, "standard"}  # the class, the allowed
                assert f"may not use priority class '{cls}'" in r["error"]["message"]
                assert "it may use standard" in r["error"]["message"]
        assert cp.app.recorder.max_notification_id() == stored  # refusals append nothing
        assert gamma.request_lease(lease_body("default"))["ok"]
        # the operator grants one class: that one is allowed, the others still are not
        assert admin.admin("tenant.set", {"tenant": "gamma", "pool_id": "p1",
                                          "priority_classes": ["high"]})["ok"]
        r = _until_ok(lambda n: gamma.request_lease(lease_body(f"high-{n}", priority="high")))
        assert r["ok"], r
        r = gamma.request_lease(lease_body("preemptible-1", priority="preemptible"))
        assert r["error"]["code"] == "priority_class_not_allowed", r
        assert set(r["error"]["reasons"]) == {"preemptible", "high", "standard"}
    shown = admin.admin("pool.show", {"pool_id": "p1"})["result"]["quotas"]["tenants"]
    assert shown["gamma"]["priority_classes"] == ["high", "standard"]
    # a grant names a class the pool has
    bad = admin.admin("tenant.set", {"tenant": "gamma", "pool_id": "p1",
                                     "priority_classes": ["gold"]})
    assert bad["error"]["code"] == "unknown_priority_class", bad


def test_a_tenant_past_its_request_rate_is_refused_until_a_token_comes_back(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, admin, alpha, clock = plane
    # a pool of its own, so no earlier request filled or cached its bucket
    assert admin.admin("pool.set", {"pool_id": "p2", "priority_classes": {"standard": 10},
                                    "requests_per_second": 2, "request_burst": 4})["ok"]
    burst = [alpha.request_lease(lease_body(f"burst-{i}", "p2")) for i in range(4)]
    assert all(r["ok"] for r in burst), burst  # the burst, each request one token
    stored = cp.app.recorder.max_notification_id()
    flood = [alpha.request_lease(lease_body(f"flood-{i}", "p2")) for i in range(200)]
    assert {r["error"]["code"] for r in flood if not r["ok"]} == {"rate_limited"}
    assert not any(r["ok"] for r in flood)
    error = flood[0]["error"]
    # the limit, named, and when to come back (the gateway's Retry-After)
    assert error["reasons"] == {"requests_per_second": 2, "request_burst": 4,
                                "retry_after_seconds": 1}, error
    assert "faster than its requests_per_second of 2 (request_burst 4)" in error["message"]
    assert cp.app.recorder.max_notification_id() == stored  # refusals append nothing
    with PoolClient(fresh_nats.url, "beta") as beta:  # the bucket is the tenant's own
        assert beta.request_lease(lease_body("beta-1", "p2"))["ok"]
    clock.advance(0.5)  # one token back at 2 a second
    assert alpha.request_lease(lease_body("later-1", "p2"))["ok"]
    assert alpha.request_lease(lease_body("later-2", "p2"))["error"]["code"] == "rate_limited"
    clock.advance(10)  # never more than the burst comes back
    again = [alpha.request_lease(lease_body(f"again-{i}", "p2"))["ok"] for i in range(6)]
    assert again == [True] * 4 + [False] * 2


def test_the_gateway_answers_rate_limited_with_429_and_retry_after() -> None:
    from gateway.problems import from_error

    r = from_error({"code": "rate_limited", "message": "too fast", "reasons": {
        "requests_per_second": 2, "request_burst": 4, "retry_after_seconds": 3}})
    assert r.status_code == 429 and r.headers["Retry-After"] == "3"


def _until_refused(request: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """`request(n)` again until it is refused or two seconds pass (the void reaches the
    command service's cache of the tenant's policy when the log stores it)."""
    deadline = time.monotonic() + 2.0
    n = 0
    while True:
        n += 1
        r = request(n)
        if not r["ok"] or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


def test_a_tenant_that_lets_its_reservations_time_out_is_refused_until_its_window_passes(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, admin, alpha, clock = plane
    assert admin.admin("pool.set", {"pool_id": "p1", "max_voided_reservations": 3,
                                    "voided_reservation_window_seconds": 600,
                                    "commit_timeout_seconds": 30})["ok"]
    # three reservations, held and never committed: reserve, let time out, repeat
    ids = [alpha.request_lease(lease_body(f"hold-{i}", cpu_millis=500))["lease"]["lease_id"]
           for i in range(3)]
    assert cp.scheduler.cycle().placed == 3
    clock.advance(31)
    # one voided by its deadline timer's handler, two by the scheduler's own sweep
    assert cp.app.reconcile_due(ids[0]) == "voided"
    assert cp.scheduler.cycle().voided == 2
    refused = _until_refused(lambda n: alpha.request_lease(lease_body(f"after-{n}")))
    assert refused["error"]["code"] == "voided_reservation_limit", refused
    assert refused["error"]["reasons"] == {"max_voided_reservations": 3,
                                           "voided_reservation_window_seconds": 600,
                                           "retry_after_seconds": 600}, refused
    assert "max_voided_reservations is 3" in refused["error"]["message"]
    stored = cp.app.recorder.max_notification_id()
    assert alpha.request_lease(lease_body("again"))["error"]["code"] == (
        "voided_reservation_limit")
    assert cp.app.recorder.max_notification_id() == stored  # refusals append nothing
    with PoolClient(fresh_nats.url, "beta") as beta:  # the record is the tenant's own
        assert beta.request_lease(lease_body("beta-1"))["ok"]
    clock.advance(600)  # the voids leave the window
    assert alpha.request_lease(lease_body("later"))["ok"]


async def _flood(url: str, tenant: str, n: int) -> list[tuple[float, dict[str, Any]]]:
    """`n` heartbeats of `tenant` sent at once: each one's answer and how long it took."""
    from bus.local.auth import inbox_prefix

    nc = await nats.connect(url, inbox_prefix=inbox_prefix(tenant).encode())
    try:
        async def one(i: int) -> tuple[float, dict[str, Any]]:
            t0 = time.monotonic()
            msg = await nc.request(f"pool.cmd.{tenant}.lease.l{i}.heartbeat", b'{"epoch": 1}',
                                   timeout=10)
            return time.monotonic() - t0, json.loads(msg.data)

        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await nc.close()


def test_a_tenant_s_flood_of_any_command_meets_its_rate_and_waits_for_its_refusals(
        fresh_nats: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOL_TENANT_COMMANDS_PER_SECOND", "5")
    monkeypatch.setenv("POOL_TENANT_COMMAND_BURST", "10")
    cp = start(fresh_nats.url, FakeClock())
    try:
        with PoolClient(fresh_nats.url, "beta") as beta:
            flood = threading.Thread(target=lambda: got.extend(
                asyncio.run(_flood(fresh_nats.url, "alpha", 60))))
            got: list[tuple[float, dict[str, Any]]] = []
            flood.start()
            time.sleep(0.3)  # the flood's refusals are being held
            t0 = time.monotonic()
            other = beta.lease("l0", "get")
            took = time.monotonic() - t0
            flood.join(30)
    finally:
        cp.stop()
    # another tenant is answered at once, from a bucket of its own
    assert other["error"]["code"] == "lease_not_found" and took < 0.5, (other, took)
    refused = [(s, r) for s, r in got if r["error"]["code"] == "rate_limited"]
    assert len(got) == 60 and len(refused) >= 60 - 12, [r["error"]["code"] for _, r in got]
    assert refused[0][1]["error"]["reasons"] == {
        "tenant_commands_per_second": 5, "tenant_command_burst": 10, "retry_after_seconds": 1}
    # each refusal held a moment: a client flooding in a closed loop waits for its answers
    assert min(s for s, _ in refused) >= 0.9, sorted(s for s, _ in refused)[:3]


def test_concurrent_requests_at_the_cap_queue_no_more_than_it(
        fresh_nats: NatsServer, plane: Plane) -> None:
    from bus.local.auth import inbox_prefix

    async def at_once(n: int) -> list[dict[str, Any]]:
        nc = await nats.connect(fresh_nats.url, inbox_prefix=inbox_prefix("alpha").encode())
        try:
            replies = await asyncio.gather(*(nc.request(
                "pool.cmd.alpha.lease.request",
                json.dumps(lease_body(f"together-{i}")).encode(), timeout=20)
                for i in range(n)))
            return [json.loads(m.data) for m in replies]
        finally:
            await nc.close()

    # each request in flight had been judged on the count before any of them was added
    got = asyncio.run(at_once(4 * QUEUE_CAP))
    accepted = [r for r in got if r["ok"]]
    assert len(accepted) <= QUEUE_CAP, f"{len(accepted)} queued past a cap of {QUEUE_CAP}"
    assert {r["error"]["code"] for r in got if not r["ok"]} == {"queue_limit_exceeded"}
