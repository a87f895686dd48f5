"""Two control planes on one log: one scheduler leads, the standby takes over when it dies."""

from __future__ import annotations

import contextlib
import time

from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, node_body, setup_pool
from workers.plane import ControlPlane


def _wait(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_standby_scheduler_takes_over_when_the_leader_dies(fresh_nats: NatsServer) -> None:
    first = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    second = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    try:
        assert _wait(lambda: first.election.is_leader or second.election.is_leader)  # type: ignore[union-attr]
        leader, standby = (first, second) if first.election.is_leader else (second, first)  # type: ignore[union-attr]
        assert not standby.election.is_leader  # type: ignore[union-attr]
        with PoolClient(fresh_nats.url) as admin, PoolClient(fresh_nats.url, "alpha") as alpha:
            setup_pool(admin)
            admin.admin("node.register", node_body("n1"))
            a = alpha.request_lease(lease_body("before"))["lease"]["lease_id"]
            assert _wait(lambda: alpha.lease(a, "get")["lease"]["state"] == "reserved")
            # the leader dies without releasing: its keeper stops renewing, its loop stops
            leader._stop.set()
            leader.election.stop(release=False)  # type: ignore[union-attr]
            started = time.monotonic()
            assert _wait(lambda: standby.election.is_leader, timeout=5)  # type: ignore[union-attr]
            takeover = time.monotonic() - started
            b = alpha.request_lease(lease_body("after"))["lease"]["lease_id"]
            assert _wait(lambda: alpha.lease(b, "get")["lease"]["state"] == "reserved")
            assert alpha.lease(b, "why")["ok"]  # the new leader answers why
        assert takeover < 3.0
    finally:
        for cp in (first, second):
            with contextlib.suppress(Exception):  # the killed one is half stopped already
                cp.stop()
