"""The scheduler places by the pool's image policy too: a workload whose isolation class is too
weak for a marketplace node never lands there, and says why when nothing else fits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, PoolClient, PoolClient]]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin, alpha = PoolClient(fresh_nats.url), PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin)
    yield cp, admin, alpha
    alpha.close()
    admin.close()
    cp.stop()


def test_a_container_workload_skips_marketplace_nodes(
        plane: tuple[ControlPlane, PoolClient, PoolClient]) -> None:
    cp, admin, alpha = plane
    assert admin.admin("node.register", node_body(
        "market", trust_level="marketplace", runtimes=["container", "sandboxed"]))["ok"]
    assert admin.admin("node.register", node_body("owned", runtimes=["container"]))["ok"]
    lid = alpha.request_lease(lease_body("c1", runtime="container"))["lease"]["lease_id"]
    cp.scheduler.cycle()
    assert alpha.lease(lid, "get")["lease"]["node_id"] == "owned"
    # a sandboxed workload may use the marketplace node (the default policy asks that much)
    lid2 = alpha.request_lease(lease_body("s1", runtime="sandboxed"))["lease"]["lease_id"]
    cp.scheduler.cycle()
    assert alpha.lease(lid2, "get")["lease"]["node_id"] == "market"


def test_with_only_marketplace_nodes_a_container_workload_is_refused_with_the_reason(
        plane: tuple[ControlPlane, PoolClient, PoolClient]) -> None:
    cp, admin, alpha = plane
    assert admin.admin("node.register", node_body(
        "market", trust_level="marketplace", runtimes=["container", "sandboxed"]))["ok"]
    lid = alpha.request_lease(lease_body("c1", runtime="container"))["lease"]["lease_id"]
    cp.scheduler.cycle()
    lease = alpha.lease(lid, "get")["lease"]
    assert lease["state"] == "rejected"
    why = alpha.lease(lid, "why")["result"]
    assert "isolation_unavailable" in str(why)
