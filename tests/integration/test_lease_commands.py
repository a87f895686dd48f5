"""Lease commands on subjects, end to end through a real nats-server and the real workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, PoolClient, PoolClient, FakeClock]]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    # a renewable term shorter than the leases' maximum runtime, so renewals have room
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, default_lease_seconds=300)
    assert admin.admin("node.register", node_body("n1"))["ok"]
    yield cp, admin, alpha, clock
    alpha.close()
    admin.close()
    cp.stop()


def _events(cp: ControlPlane) -> int:
    return cp.app.recorder.max_notification_id() or 0


def test_a_lease_goes_from_request_to_release(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    cp, _admin, alpha, clock = plane
    r = alpha.request_lease(lease_body("job-1"))
    assert r["ok"], r
    lid = r["lease"]["lease_id"]
    assert r["lease"]["state"] == "queued"
    report = cp.scheduler.cycle()
    assert report.placed == 1
    got = alpha.lease(lid, "get")["lease"]
    assert got["state"] == "reserved" and got["node_id"] == "n1" and got["epoch"] == 1
    assert got["hold_microcredits"] >= 0
    c = alpha.lease(lid, "commit", {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}})
    assert c["ok"], c
    assert c["lease"]["state"] == "running"
    clock.advance(5)
    assert alpha.lease(lid, "heartbeat", {"epoch": 1})["ok"]
    renewed = alpha.lease(lid, "renew", {"extend_seconds": 60})
    assert renewed["ok"], renewed
    done = alpha.lease(lid, "release", {"exit_code": 0})
    assert done["ok"], done
    assert done["lease"]["state"] == "released"


def test_a_retried_request_returns_the_same_lease_and_appends_nothing(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    cp, _admin, alpha, _clock = plane
    first = alpha.request_lease(lease_body("same-key"))
    before = _events(cp)
    for _ in range(5):
        again = alpha.request_lease(lease_body("same-key"))
        assert again["lease"]["lease_id"] == first["lease"]["lease_id"]
    assert _events(cp) == before


def test_the_same_key_for_a_different_request_is_refused(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    _cp, _admin, alpha, _clock = plane
    alpha.request_lease(lease_body("k1"))
    r = alpha.request_lease(lease_body("k1", cpu_millis=2000))
    assert not r["ok"] and r["error"]["code"] == "idempotency_conflict"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "malformed_json"),
        (b'{"pool_id": 5}', "invalid_field"),
        (b"\xff\xfe", "invalid_utf8"),
        (b'{"pool_id":"p1","shape":{"cpu_milis":1,"memory_mib":1},"maximum_runtime_seconds":60,"idempotency_key":"x"}', "unknown_field"),
        (b'{"pool_id":"p1","shape":{"cpu_millis":-1,"memory_mib":1},"maximum_runtime_seconds":60,"idempotency_key":"x"}', "invalid_field"),
        (b'{"pool_id":"nope","shape":{"cpu_millis":1,"memory_mib":1},"maximum_runtime_seconds":60,"idempotency_key":"x"}', "unknown_pool"),
        (b'{"pool_id":"p1","shape":{"cpu_millis":1,"memory_mib":1},"maximum_runtime_seconds":60,"idempotency_key":"x","priority_class":"vip"}', "unknown_priority_class"),
        (b"x" * 70000, "payload_too_large"),
    ],
)
def test_every_malformed_request_gets_a_typed_error_and_appends_nothing(
    plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock], body: bytes, code: str
) -> None:
    cp, _admin, alpha, _clock = plane
    before = _events(cp)
    r = alpha.raw("pool.cmd.alpha.lease.request", body)
    assert r["ok"] is False and r["error"]["code"] == code, r
    assert _events(cp) == before
    assert alpha.request_lease(lease_body("after-bad-input"))["ok"]  # still serving


def test_a_lease_of_another_tenant_reads_as_not_found(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    cp, _admin, alpha, _clock = plane
    lid = alpha.request_lease(lease_body("mine"))["lease"]["lease_id"]
    with PoolClient(cp.nats_url, "beta") as beta:
        for verb in ("get", "cancel", "release", "why"):
            r = beta.lease(lid, verb)
            assert r["error"]["code"] == "lease_not_found", (verb, r)
    assert alpha.lease(lid, "get")["lease"]["state"] == "queued"


def test_an_illegal_transition_is_refused_with_its_code(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    _cp, _admin, alpha, _clock = plane
    lid = alpha.request_lease(lease_body("early"))["lease"]["lease_id"]
    r = alpha.lease(lid, "commit", {})
    assert r["ok"] is False and r["error"]["code"] == "illegal_transition", r


def test_an_uncommitted_reservation_is_voided_and_its_capacity_returned(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    cp, _admin, alpha, clock = plane
    lid = alpha.request_lease(lease_body("slow", cpu_millis=8000))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 1
    other = alpha.request_lease(lease_body("waiting", cpu_millis=8000))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 0
    clock.advance(31)  # the pool's commit timeout is 30 s
    report = cp.scheduler.cycle()
    assert report.voided == 1 and report.placed == 1
    assert alpha.lease(lid, "get")["lease"]["state"] == "voided"
    assert alpha.lease(other, "get")["lease"]["state"] == "reserved"


def test_a_silent_lease_expires_into_reconciliation_and_keeps_its_capacity(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    cp, _admin, alpha, clock = plane
    lid = alpha.request_lease(lease_body("silent", cpu_millis=8000))["lease"]["lease_id"]
    cp.scheduler.cycle()
    assert alpha.lease(lid, "commit", {})["ok"]
    cp.scheduler.cycle()
    clock.advance(31)  # heartbeat timeout 30 s
    assert cp.scheduler.cycle().expired == 1
    assert alpha.lease(lid, "get")["lease"]["state"] == "reconciling"
    waiting = alpha.request_lease(lease_body("next", cpu_millis=8000))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 0  # never silently recycled
    assert alpha.lease(waiting, "get")["lease"]["state"] == "queued"


def test_cancel_of_a_reserved_lease_frees_its_node(plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    cp, _admin, alpha, _clock = plane
    lid = alpha.request_lease(lease_body("c1", cpu_millis=8000))["lease"]["lease_id"]
    cp.scheduler.cycle()
    nxt = alpha.request_lease(lease_body("c2", cpu_millis=8000))["lease"]["lease_id"]
    assert alpha.lease(lid, "cancel", {"reason": "changed my mind"})["lease"]["state"] == "cancelled"
    assert cp.scheduler.cycle().placed == 1
    assert alpha.lease(nxt, "get")["lease"]["state"] == "reserved"


def test_a_heartbeat_reads_its_node_once_when_nothing_conflicts(
        plane: tuple[ControlPlane, PoolClient, PoolClient, FakeClock]) -> None:
    from domain.node import Node
    from schemas import v1

    cp, _admin, alpha, _clock = plane
    # a reservation not yet committed: the node holds a lease its agent does not run, so the
    # heartbeat also looks for leases to reconcile
    lid = alpha.request_lease(lease_body("held"))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 1
    reads: list[object] = []
    find = cp.app.store.find

    def counted(cls: type, uid: object) -> object:
        if cls is Node:
            reads.append(uid)
        return find(cls, uid)  # type: ignore[arg-type]

    cp.app.store.find = counted  # type: ignore[method-assign]
    answer = cp.app.node_heartbeat("n1", v1.NodeHeartbeat(node_id="n1", seq=1))
    assert answer["node_state"] == "ready" and lid not in answer["leases"]
    assert len(reads) == 1  # a cached node's read is a round trip to the log
