"""Advance reservations and maintenance windows against a real log and scheduler: capacity kept
for one tenant's leases that name the reservation, whole nodes kept for maintenance, both
folded from the log by whichever scheduler runs."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bus.local.server import NatsServer
from cli.main import main
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane

Plane = tuple[ControlPlane, PoolClient, FakeClock]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    assert admin.admin("node.register", node_body("n1", cpu_millis=4000))["ok"]
    yield cp, admin, clock
    admin.close()
    cp.stop()


def _reserve(admin: PoolClient, clock: FakeClock, *, start_in: float = 0.0,
             duration: int = 600, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"pool_id": "p1", "reservation_id": "r1",
                            "start_at": clock() + start_in, "duration_seconds": duration}
    body.update(kw)
    reply = admin.admin("reservation.create", body)
    assert reply["ok"], reply
    return dict(reply["result"])


def _for_alpha(admin: PoolClient, clock: FakeClock, **kw: Any) -> dict[str, Any]:
    # one unit holds a whole lease of the node's cores (lease_body asks 1024 MiB)
    return _reserve(admin, clock, tenant="alpha",
                    shape={"cpu_millis": 4000, "memory_mib": 1024}, **kw)


def _state(client: PoolClient, lease_id: str) -> str:
    return str(client.lease(lease_id, "get")["lease"]["state"])


def _ask(client: PoolClient, key: str, reservation_id: str | None = None, **kw: Any) -> str:
    body = lease_body(key, **kw)
    if reservation_id is not None:
        body["reservation_id"] = reservation_id
    reply = client.request_lease(body)
    assert reply["ok"], reply
    return str(reply["lease"]["lease_id"])


def test_another_tenant_cannot_take_reserved_capacity_during_the_window(plane: Plane) -> None:
    cp, admin, clock = plane
    _for_alpha(admin, clock)
    with PoolClient(cp.nats_url, "beta") as b:
        lid = _ask(b, "b1")
        assert cp.scheduler.cycle().placed == 0
        assert _state(b, lid) == "queued"
        why = b.lease(lid, "why")["result"]["reasons"]
        assert (why["tenant"], why["windows"]) == (["waiting_for_reservation"], ["r1"])


def test_the_named_tenants_lease_that_names_it_uses_the_reservation(plane: Plane) -> None:
    cp, admin, clock = plane
    _for_alpha(admin, clock)
    with PoolClient(cp.nats_url, "alpha") as a:
        plain = _ask(a, "plain", cpu_millis=1000)
        assert cp.scheduler.cycle().placed == 0  # its own lease must name the reservation
        # ending within the window: after it, the waiting plain lease is next
        named = _ask(a, "named", cpu_millis=4000, max_runtime=300, reservation_id="r1")
        assert cp.scheduler.cycle().placed == 1
        assert (_state(a, named), _state(a, plain)) == ("reserved", "queued")


def test_a_lease_cannot_name_another_tenants_reservation(plane: Plane) -> None:
    cp, admin, clock = plane
    _for_alpha(admin, clock)
    with PoolClient(cp.nats_url, "beta") as b:
        reply = b.request_lease({**lease_body("b1"), "reservation_id": "r1"})
    assert reply["ok"] is False and reply["error"]["code"] == "unknown_reservation"


def test_before_the_window_a_lease_that_ends_in_time_is_placed(plane: Plane) -> None:
    cp, admin, clock = plane
    _for_alpha(admin, clock, start_in=1000)
    with PoolClient(cp.nats_url, "beta") as b:
        long = _ask(b, "long", max_runtime=3600)
        short = _ask(b, "short", max_runtime=600)  # ends by now + 30 s commit + 600 s
        assert cp.scheduler.cycle().placed == 1
        assert (_state(b, short), _state(b, long)) == ("reserved", "queued")


def test_capacity_returns_when_the_window_ends_or_is_deleted(plane: Plane) -> None:
    cp, admin, clock = plane
    _for_alpha(admin, clock, duration=600)
    with PoolClient(cp.nats_url, "beta") as b:
        lid = _ask(b, "b1")
        assert cp.scheduler.cycle().placed == 0
        clock.advance(600)
        assert cp.scheduler.cycle().placed == 1
        assert _state(b, lid) == "reserved"
    _reserve(admin, clock, reservation_id="r2", tenant="alpha", shape={"cpu_millis": 3000})
    with PoolClient(cp.nats_url, "beta") as b:
        lid = _ask(b, "b2", cpu_millis=2000)
        assert cp.scheduler.cycle().placed == 0
        assert admin.admin("reservation.delete", {"pool_id": "p1", "reservation_id": "r2"})["ok"]
        assert cp.scheduler.cycle().placed == 1


def test_a_reservation_survives_a_scheduler_restart(plane: Plane,
                                                    fresh_nats: NatsServer) -> None:
    _cp, admin, clock = plane
    _for_alpha(admin, clock)
    # a new plane folds the log from the start, as a restarted or newly elected one does
    again = start(fresh_nats.url, clock)
    try:
        with PoolClient(again.nats_url, "beta") as b, PoolClient(again.nats_url, "alpha") as a:
            other = _ask(b, "b1")
            assert again.scheduler.cycle().placed == 0
            named = _ask(a, "a1", cpu_millis=4000, max_runtime=300, reservation_id="r1")
            assert again.scheduler.cycle().placed == 1
            assert (_state(a, named), _state(b, other)) == ("reserved", "queued")
    finally:
        again.stop()


def test_a_plane_stopping_leaves_another_of_the_same_process_working(
        plane: Plane, fresh_nats: NatsServer) -> None:
    """The restart above starts a second plane beside the first: stopping it closed the
    process-wide bus runtime the first still used (its dispatcher failed on a closed runtime
    and its teardown, now and then, on a closed event loop)."""
    cp, _admin, _clock = plane
    start(fresh_nats.url, cp.scheduler.clock).stop()
    with PoolClient(cp.nats_url, "alpha") as a:
        reply = a.request_lease(lease_body("after-the-other-stopped"))
    assert reply["ok"], reply
    assert cp.scheduler.cycle().placed == 1


def test_a_maintenance_window_keeps_new_leases_that_would_run_into_it_off_its_node(
        plane: Plane) -> None:
    cp, admin, clock = plane
    _reserve(admin, clock, start_in=1000, node_ids=["n1"])
    with PoolClient(cp.nats_url, "alpha") as a:
        long = _ask(a, "long", max_runtime=3600)
        short = _ask(a, "short", max_runtime=600)
        assert cp.scheduler.cycle().placed == 1
        assert (_state(a, short), _state(a, long)) == ("reserved", "queued")


def test_a_create_repeated_is_answered_and_a_different_one_refused(plane: Plane) -> None:
    _cp, admin, clock = plane
    first = _for_alpha(admin, clock)
    assert _for_alpha(admin, clock) == first
    reply = admin.admin("reservation.create", {
        "pool_id": "p1", "reservation_id": "r1", "tenant": "alpha", "start_at": clock(),
        "duration_seconds": 60, "shape": {"cpu_millis": 4000}})
    assert reply["ok"] is False and reply["error"]["code"] == "reservation_exists"
    reply = admin.admin("reservation.create", {
        "pool_id": "p1", "reservation_id": "m1", "start_at": clock(),
        "duration_seconds": 60, "node_ids": ["nope"]})
    assert reply["ok"] is False and reply["error"]["code"] == "unknown_node"


def test_the_cli_creates_lists_and_deletes_a_reservation(
        plane: Plane, capsys: pytest.CaptureFixture[str]) -> None:
    cp, _admin, clock = plane
    at = dt.datetime.fromtimestamp(clock() + 3600, dt.UTC).isoformat()
    url = ["--nats-url", cp.nats_url]
    assert main(["admin", "reservation", "create", *url, "--pool", "p1", "--id", "gpu-week",
                 "--tenant", "alpha", "--start", at, "--duration", "4h", "--cpu-millis", "2000",
                 "--count", "2", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)["result"]
    assert (made["start_at"], made["end_at"], made["status"]) == (
        clock() + 3600, clock() + 3600 + 4 * 3600, "upcoming")
    assert main(["admin", "reservation", "list", *url, "--pool", "p1"]) == 0
    assert "gpu-week" in capsys.readouterr().out
    assert main(["admin", "reservation", "delete", "gpu-week", *url, "--pool", "p1"]) == 0
    capsys.readouterr()
    assert main(["admin", "reservation", "list", *url, "--pool", "p1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["reservations"] == []
    assert main(["admin", "reservation", "create", *url, "--pool", "p1", "--tenant", "alpha",
                 "--start", "+1h", "--duration", "soon", "--gpus", "1"]) == 2
    assert "--duration" in capsys.readouterr().err


def test_a_maintenance_window_notices_running_leases_that_would_run_into_it_once(
        plane: Plane) -> None:
    from domain.reservation import CapacityReservation

    cp, admin, clock = plane
    with PoolClient(cp.nats_url, "alpha") as a:
        long = _ask(a, "long", cpu_millis=2000, max_runtime=3600)
        short = _ask(a, "short", cpu_millis=1000, max_runtime=600)
        assert cp.scheduler.cycle().placed == 2
        for lid in (long, short):
            assert a.lease(lid, "commit", {})["ok"]
        _reserve(admin, clock, reservation_id="m1", start_in=1000, node_ids=["n1"])
        rid = str(CapacityReservation.create_id("p1", "m1"))
        grace = admin.admin("pool.show", {"pool_id": "p1"})["result"]["config"][
            "preemption"]["grace_seconds"]
        drain_at = clock() + 1000 - grace
        assert cp.dispatcher is not None
        # the plane's dispatcher arms the durable timer (a JetStream scheduled message)
        deadline = time.monotonic() + 20
        while f"reservation:{rid}" not in cp.dispatcher._armed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cp.dispatcher._armed[f"reservation:{rid}"] == drain_at
        assert cp.app.reservation_due(rid) is None  # fired early: nothing yet
        assert cp.app.reservation_next_due(rid) == drain_at
        clock.advance(1000 - grace)
        assert cp.app.reservation_due(rid) == "drained:1"
        assert (_state(a, long), _state(a, short)) == ("preempting", "running")
        assert cp.app.reservation_due(rid) is None  # a timer fired again drains nothing
        assert cp.app.reservation_next_due(rid) is None
