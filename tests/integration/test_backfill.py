"""EASY backfill in the scheduler against a real log: a blocked wide request holds a reservation,
later requests are placed only where they cannot delay it, and `why` says where each one stands."""

from __future__ import annotations

import datetime as dt

import pytest

from cli.main import main
from client.api import PoolClient
from tests.control_plane import Plane, lease_body, node_body, setup_pool


def _state(client: PoolClient, lease_id: str) -> str:
    return str(client.lease(lease_id, "get")["lease"]["state"])


def _blocked_wide(plane: Plane) -> tuple[PoolClient, PoolClient, str, float]:
    """One 4-core node, half of it reserved for 600 s; beta's 4-core request waits."""
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    admin.admin("node.register", node_body("n1", cpu_millis=4000))
    a, b = PoolClient(cp.nats_url, "alpha"), PoolClient(cp.nats_url, "beta")
    a.request_lease(lease_body("running", cpu_millis=2000, max_runtime=600))
    placed_at = clock()
    assert cp.scheduler.cycle().placed == 1
    wide = b.request_lease(lease_body("wide", cpu_millis=4000))["lease"]["lease_id"]
    cp.scheduler.cycle()
    return a, b, wide, placed_at


def test_a_blocked_wide_request_is_told_its_position_and_reserved_start(plane: Plane) -> None:
    a, b, wide, placed_at = _blocked_wide(plane)
    with a, b:
        answer = b.lease(wide, "why")["result"]
    why = answer["reasons"]
    assert (answer["position"], answer["estimated_start_at"]) == (1, placed_at + 630)
    assert answer["estimated_start_in_seconds"] == 630
    assert "waiting_for_capacity" in why["tenant"]
    # the running lease holds its half until its commit window and maximum runtime are over
    assert why["queue"] == {"position": 1, "estimated_start_at": placed_at + 30 + 600,
                            "reserved": True, "reserved_node_id": "n1"}


def test_a_later_request_that_would_delay_the_reservation_waits(plane: Plane) -> None:
    cp, _admin, _clock = plane
    a, b, wide, _ = _blocked_wide(plane)
    with a, b:
        long = a.request_lease(lease_body("long", cpu_millis=2000, max_runtime=3600))
        lid = long["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 0
        assert _state(a, lid) == "queued"
        why = a.lease(lid, "why")["result"]["reasons"]
        assert why["tenant"] == ["waiting_for_reservation"]
        assert why["queue"]["position"] == 2 and why["queue"]["reserved"] is False
        # one that ends before the reservation begins may use the gap
        short = a.request_lease(lease_body("short", cpu_millis=2000, max_runtime=60))
        assert cp.scheduler.cycle().placed == 1
        assert _state(a, short["lease"]["lease_id"]) == "reserved"
        assert _state(b, wide) == "queued"


def test_without_backfill_the_later_request_takes_the_wide_ones_capacity(plane: Plane) -> None:
    cp, _admin, _clock = plane
    cp.scheduler.backfill = False
    a, b, wide, _ = _blocked_wide(plane)
    with a, b:
        long = a.request_lease(lease_body("long", cpu_millis=2000, max_runtime=3600))
        assert cp.scheduler.cycle().placed == 1
        assert _state(a, long["lease"]["lease_id"]) == "reserved"
        # the estimate is still given, as a bound rather than a promise
        queue = b.lease(wide, "why")["result"]["reasons"]["queue"]
        assert queue["reserved"] is False and queue["estimated_start_at"] is not None


def test_a_tenant_lists_its_waiting_leases_in_queue_order_with_estimates(plane: Plane) -> None:
    cp, _admin, _clock = plane
    a, b, wide, placed_at = _blocked_wide(plane)
    with a, b:
        long = a.request_lease(lease_body("long", cpu_millis=2000, max_runtime=3600))
        cp.scheduler.cycle()
        mine = a.queue_positions()["result"]["leases"]
        theirs = b.queue_positions()["result"]["leases"]
    assert [(r["lease_id"], r["position"], r["reserved"]) for r in mine] == [
        (long["lease"]["lease_id"], 2, False)]
    assert [(r["lease_id"], r["position"], r["estimated_start_at"], r["reserved"])
            for r in theirs] == [(wide, 1, placed_at + 630, True)]


def test_pool_lease_queue_prints_the_position_and_estimated_start(
        plane: Plane, capsys: pytest.CaptureFixture[str]) -> None:
    cp, _admin, _clock = plane
    a, b, wide, placed_at = _blocked_wide(plane)
    a.close()
    b.close()
    assert main(["lease", "queue", "--nats-url", cp.nats_url, "--tenant", "beta"]) == 0
    out = capsys.readouterr().out
    assert wide in out and "True" in out
    when = dt.datetime.fromtimestamp(placed_at + 630, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert when in out


def test_a_placement_past_a_reservation_names_it_in_its_recorded_terms(plane: Plane) -> None:
    """A request that waited (its quota), then placed in the gap before the wide head's
    reservation: its decision record names that reservation (head, node, start)."""
    cp, admin, clock = plane
    a, b, wide, placed_at = _blocked_wide(plane)
    with a, b:
        assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                          "quota": {"cpu_millis": 2000}})["ok"]
        short = a.request_lease(lease_body("short", cpu_millis=2000, max_runtime=60))
        lid = short["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 0  # alpha's quota keeps it waiting: recorded
        clock.advance(1)
        assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                          "quota": {"cpu_millis": 8000}})["ok"]
        assert cp.scheduler.cycle().placed == 1
        assert _state(b, wide) == "queued"
        record = a.lease(lid, "why", {"at": clock() + 1})["result"]["record"]
    terms = record["terms"]
    assert terms["backfill"] is True
    (held,) = terms["reservations"]
    assert (held["lease_id"], held["node_id"]) == (wide, "n1")
    assert held["start_at"] == placed_at + 30 + 600
