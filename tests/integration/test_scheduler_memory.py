"""What the scheduler keeps in memory: queued requests compactly, ended leases not at all."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import UUID

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from control.pending import QueuedLease
from control.plane import ControlPlane
from domain.lease import Lease
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start

Plane = tuple[ControlPlane, PoolClient, FakeClock]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    yield cp, admin, clock
    admin.close()
    cp.stop()


def test_waiting_requests_stay_compact_and_placed_ones_become_whole_leases(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=5000))
    with PoolClient(cp.nats_url, "alpha") as alpha:
        ids = [alpha.request_lease(lease_body(f"m{i}"))["lease"]["lease_id"] for i in range(12)]
        report = cp.scheduler.cycle()
        assert report.placed == 5 and report.waiting == 7
        memory = cp.scheduler.aggregates
        held = {lid: memory.peek(UUID(lid)) for lid in ids}
        assert sum(isinstance(a, Lease) and a.state.value == "reserved"
                   for a in held.values()) == 5
        assert sum(isinstance(a, QueuedLease) for a in held.values()) == 7
        waiting = next(lid for lid, a in held.items() if isinstance(a, QueuedLease))
        why = alpha.lease(waiting, "why")["result"]
        assert why["state"] == "queued" and "waiting_for_capacity" in why["reasons"]["tenant"]
        # a second cycle examines the waiting ones again and leaves them compact
        assert cp.scheduler.cycle().placed == 0
        assert sum(isinstance(memory.peek(UUID(lid)), QueuedLease) for lid in ids) == 7


def test_ended_leases_leave_memory_once_settled_and_why_still_answers(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=2000))
    with PoolClient(cp.nats_url, "alpha") as alpha:
        huge = alpha.request_lease(lease_body("huge", cpu_millis=64_000))["lease"]["lease_id"]
        gone = alpha.request_lease(lease_body("gone"))["lease"]["lease_id"]
        cp.scheduler.cycle()  # rejects `huge` (no node could ever hold it) in its own save
        assert alpha.lease(gone, "cancel", {"reason": "changed my mind"})["ok"]
        placed = alpha.request_lease(lease_body("kept"))["lease"]["lease_id"]
        cp.scheduler.cycle()  # reads the cancel, places `kept`
        memory = cp.scheduler.aggregates
        assert UUID(huge) not in memory and UUID(gone) not in memory
        assert isinstance(memory.peek(UUID(placed)), Lease)
        why = alpha.lease(huge, "why")["result"]
        assert why["state"] == "rejected"
        assert why["reasons"]["filters"]["insufficient_cpu"] == 1
        assert alpha.lease(gone, "why")["result"]["state"] == "cancelled"
    with PoolClient(cp.nats_url, "beta") as beta:  # another tenant learns nothing of it
        assert not beta.lease(huge, "why")["ok"]
