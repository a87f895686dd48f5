"""GPU leases bound to devices, end to end on a real log: the scheduler picks concrete devices,
records them, returns exactly them, the start order carries them, and the replay checks them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from domain.lease import Lease
from domain.node import Node
from domain.resources import LeaseId
from projections.decisions import check_placements
from schemas import v1
from tests.control_plane import (
    FakeClock,
    lease_body,
    node_body,
    race,
    rival_schedulers,
    setup_pool,
    start,
)
from workers.dispatcher import orders_for
from workers.plane import ControlPlane

Plane = tuple[ControlPlane, PoolClient, PoolClient, FakeClock]


def gpu_node(node_id: str, gpus: int = 4, **kw: Any) -> dict[str, Any]:
    body = node_body(node_id, gpu_count=gpus, gpu_model="NVIDIA A100 80GB", gpu_memory_gib=80,
                     **kw)
    body["capabilities"]["devices"] = [
        {"id": f"GPU-{node_id}-{k}", "model": "NVIDIA A100 80GB", "memory_mib": 80 * 1024,
         "minor": k, "nvlink_domain": f"{node_id}-nv{k // 2}"} for k in range(gpus)]
    return body


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0})
    yield cp, admin, alpha, clock
    alpha.close()
    admin.close()
    cp.stop()


def _get(alpha: PoolClient, lid: str) -> dict[str, Any]:
    got: dict[str, Any] = alpha.lease(lid, "get")["lease"]
    return got


def test_two_one_gpu_leases_on_one_node_get_different_devices_and_a_pair_gets_peers(
        plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    assert admin.admin("node.register", gpu_node("g1"))["ok"]
    ids = [alpha.request_lease(lease_body(k, gpu_count=n))["lease"]["lease_id"]
           for k, n in (("one-a", 1), ("one-b", 1), ("two", 2))]
    assert cp.scheduler.cycle().placed == 3
    got = {lid: _get(alpha, lid)["devices"] for lid in ids}
    one_a, one_b, two = (got[i] for i in ids)
    assert len(one_a) == len(one_b) == 1 and one_a != one_b
    assert sorted(two) in (["GPU-g1-0", "GPU-g1-1"], ["GPU-g1-2", "GPU-g1-3"])  # NVLink peers
    assert len(set(one_a + one_b + two)) == 4
    report = check_placements(cp.app)
    assert report.double_placements == 0 and report.device_violations == 0


def test_a_cancelled_reservation_returns_exactly_its_devices_to_the_next_lease(
        plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    assert admin.admin("node.register", gpu_node("g1", gpus=2))["ok"]
    first = alpha.request_lease(lease_body("first", gpu_count=1))["lease"]["lease_id"]
    second = alpha.request_lease(lease_body("second", gpu_count=1))["lease"]["lease_id"]
    cp.scheduler.cycle()
    freed = _get(alpha, first)["devices"]
    kept = _get(alpha, second)["devices"]
    assert alpha.lease(first, "cancel", {})["ok"]
    third = alpha.request_lease(lease_body("third", gpu_count=1))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 1
    assert _get(alpha, third)["devices"] == freed != kept
    node: Node = cp.app.repository.get(Node.create_id("g1"))
    assert set(node.held_devices) == set(freed + kept)
    assert node.devices_of(LeaseId(first)) == ()
    assert check_placements(cp.app).device_violations == 0


def test_the_start_order_carries_the_leases_devices(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    assert admin.admin("node.register", gpu_node("g1", gpus=2))["ok"]
    lid = alpha.request_lease(lease_body("job", gpu_count=1))["lease"]["lease_id"]
    cp.scheduler.cycle()
    assert alpha.lease(lid, "commit", {"job": {"image": "busybox@sha256:" + "a" * 64,
                                               "command": ["nvidia-smi", "-L"]}})["ok"]
    lease: Lease = cp.app.repository.get(Lease.create_id("alpha", "job"))
    (order,) = orders_for("LeaseCommitted", lease, None)
    assignment = msgspec.json.decode(order.body, type=v1.LeaseAssignment)
    assert assignment.devices == list(lease.devices) == _get(alpha, lid)["devices"]
    assert len(assignment.devices) == 1


def test_a_registration_whose_devices_disagree_with_its_gpus_is_refused(plane: Plane) -> None:
    _cp, admin, _alpha, _clock = plane
    body = gpu_node("bad", gpus=4)
    body["capabilities"]["devices"] = body["capabilities"]["devices"][:3]
    r = admin.admin("node.register", body)
    assert not r["ok"] and r["error"]["code"] in ("invalid_field", "invalid_value",
                                                  "validation_failed"), r
    assert "devices disagree" in r["error"]["message"]


def test_the_replay_check_finds_a_device_given_to_two_leases(plane: Plane) -> None:
    cp, admin, _alpha, _clock = plane
    assert admin.admin("node.register", gpu_node("g1", gpus=2))["ok"]
    node: Node = cp.app.repository.get(Node.create_id("g1"))
    # written past the domain's own refusal, as a buggy writer would: the checker must see it
    res = {"cpu_millis": 100, "memory_mib": 100, "gpu_count": 1, "local_disk_gib": 0}
    node._capacity_allocated(lease_id="x", resources=res, at=1.0, devices=["GPU-g1-0"])
    node._capacity_allocated(lease_id="y", resources=res, at=1.0, devices=["GPU-g1-0"])
    node._capacity_allocated(lease_id="z", resources={**res, "gpu_count": 0}, at=1.0,
                             devices=["GPU-elsewhere"])
    cp.app.save(node)
    report = check_placements(cp.app)
    assert len(report.device_conflicts) == 1 and "GPU-g1-0" in report.device_conflicts[0]
    assert len(report.foreign_devices) == 1 and "GPU-elsewhere" in report.foreign_devices[0]
    assert report.double_placements == 1


def test_capacity_by_rack_shows_free_gpus_and_whole_free_nodes_per_rack(
        plane: Plane, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    cp, admin, alpha, _clock = plane
    for node, rack in (("a1", "rack-1"), ("a2", "rack-1"), ("b1", "rack-2")):
        assert admin.admin("node.register", gpu_node(node, labels={"rack": rack}))["ok"]
    alpha.request_lease(lease_body("one", gpu_count=1))
    assert cp.scheduler.cycle().placed == 1
    assert main(["capacity", "--by", "rack", "--nats-url", cp.nats_url, "--json"]) == 0
    rows = {r["rack"]: r for r in json.loads(capsys.readouterr().out)["result"]["rows"]}
    assert rows["rack-1"]["nodes"] == 2 and rows["rack-2"]["gpus"] == 4
    assert rows["rack-1"]["gpus_free"] + rows["rack-2"]["gpus_free"] == 11
    assert rows["rack-1"]["whole_gpu_nodes_free"] + rows["rack-2"]["whole_gpu_nodes_free"] == 2
    assert main(["capacity", "--by", "hostname", "--nats-url", cp.nats_url]) != 0
    assert "--by" in capsys.readouterr().err


def test_racing_schedulers_never_give_one_device_to_two_leases(plane: Plane) -> None:

    from workers.scheduler import Scheduler

    cp, admin, alpha, clock = plane
    for i in range(3):
        assert admin.admin("node.register", gpu_node(f"g{i}"))["ok"]
    for i in range(30):
        alpha.request_lease(lease_body(f"r{i}", gpu_count=1 + i % 2, cpu_millis=100))
    rivals = rival_schedulers(cp, clock)

    def four_cycles(s: Scheduler) -> None:
        for _ in range(4):
            s.cycle()

    race(rivals, four_cycles)
    report = check_placements(cp.app)  # every node, every instant
    assert report.device_placements > 0
    assert report.device_violations == 0 and report.double_placements == 0, (
        report.device_conflicts + report.foreign_devices + report.over_allocations)
    held = sum(len(cp.app.repository.get(Node.create_id(f"g{i}")).held_devices)
               for i in range(3))
    assert held <= 12  # three nodes of four GPUs
    for s in rivals:
        s.app.close()
