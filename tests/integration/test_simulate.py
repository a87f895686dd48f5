"""The simulated fleet: real Agents over one shared connection, timed-sleep workloads, the same
subjects as a real agent; a node that goes silent is lost and its lease reconciled."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from agents.simulate import SimulatedFleet, fleet
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import setup_pool
from workers.plane import ControlPlane


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[str, PoolClient, PoolClient]]:
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    admin, acme = PoolClient(fresh_nats.url), PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, "sim", tenants={"alpha": 1.0}, heartbeat_timeout_seconds=2,
               node_timeout_seconds=3, lost_node_release_seconds=3)
    yield fresh_nats.url, admin, acme
    acme.close()
    admin.close()
    cp.stop()


def drive(client: PoolClient, ids: list[str], timeout: float = 40.0) -> dict[str, Any]:
    """Commit each lease once reserved; return the final leases once all have ended."""
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids) and time.monotonic() < deadline:
        for lid in ids:
            if lid in done:
                continue
            lease = client.lease(lid, "get")["lease"]
            if lease["state"] == "reserved":
                client.lease(lid, "commit", {"job": {"image": "r/j@sha256:" + "c" * 64,
                                                     "command": ["sleep", "1"]}})
            elif lease["state"] in ("released", "cancelled", "rejected", "preempted"):
                done[lid] = lease
        time.sleep(0.1)
    return done


def test_a_simulated_fleet_runs_every_committed_lease_to_completion(
        plane: tuple[str, PoolClient, PoolClient]) -> None:
    url, admin, acme = plane
    # generous timeouts: this test is about throughput, not expiry, on a busy machine
    assert admin.admin("pool.set", {"pool_id": "sim", "priority_classes": {"standard": 10},
                                    "heartbeat_timeout_seconds": 10,
                                    "node_timeout_seconds": 15})["ok"]
    sim = SimulatedFleet(url, fleet(20), pool_id="sim", heartbeat_interval=0.5).start()
    try:
        ids = [acme.request_lease({"pool_id": "sim", "maximum_runtime_seconds": 60,
                                   "idempotency_key": f"k{i}",
                                   "shape": {"cpu_millis": 4000, "memory_mib": 4096}}
                                  )["lease"]["lease_id"] for i in range(30)]
        done = drive(acme, ids)
        assert len(done) == 30
        assert {(x["state"], x["exit_code"]) for x in done.values()} == {("released", 0)}
        assert sim.stats()["started"] == 30 and sim.stats()["errors"] == 0
    finally:
        sim.stop()


def test_a_silent_simulated_node_is_lost_and_its_lease_released_after_the_timeout(
        plane: tuple[str, PoolClient, PoolClient]) -> None:
    url, _admin, acme = plane
    sim = SimulatedFleet(url, fleet(1, "cpu"), pool_id="sim", heartbeat_interval=0.5).start()
    try:
        lid = acme.request_lease({"pool_id": "sim", "maximum_runtime_seconds": 60,
                                  "idempotency_key": "quiet",
                                  "shape": {"cpu_millis": 1000, "memory_mib": 1024}}
                                 )["lease"]["lease_id"]
        deadline = time.monotonic() + 15
        while acme.lease(lid, "get")["lease"]["state"] != "reserved":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert acme.lease(lid, "commit", {"job": {"command": ["sleep", "30"]}})["ok"]
        while sim.running() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        sim.go_silent("sim-0000")
        # heartbeat timeout → expired → reconciling; node timeout → lost; after the lost-node
        # release timeout the lease is released without the agent's word, capacity freed
        states = set()
        deadline = time.monotonic() + 30
        while (lease := acme.lease(lid, "get")["lease"])["state"] != "released":
            states.add(lease["state"])
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        assert "reconciling" in states
        assert lease["end_reason"] in ("heartbeat_lost", "node_lost")
    finally:
        sim.stop()
