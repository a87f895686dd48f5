"""`pool bench policy --from-log`: a pool's leases in a real log replayed through each policy."""

from __future__ import annotations

import json

import pytest

from bench.policy import NothingToReplay, workload_from_log
from cli.main import main
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}


def _history(cp: ControlPlane, admin: PoolClient, clock: FakeClock) -> tuple[str, str]:
    """Two tenants on one 4-core node: alpha ran 2 cores for 100 s, beta still waits."""
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 3.0}, default_lease_seconds=3600,
               heartbeat_timeout_seconds=3600)
    admin.admin("node.register", node_body("n1", cpu_millis=4000))
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        ran = a.request_lease(lease_body("ran", cpu_millis=4000, max_runtime=600))
        cp.scheduler.cycle()
        lid = ran["lease"]["lease_id"]
        assert a.lease(lid, "commit", JOB)["ok"]
        clock.advance(30)
        waits = b.request_lease(lease_body("waits", cpu_millis=4000, max_runtime=300))
        cp.scheduler.cycle()
        clock.advance(70)
        assert a.lease(lid, "release", {"exit_code": 0})["ok"]
        return lid, waits["lease"]["lease_id"]


def test_a_pools_leases_replay_with_their_observed_runtimes(plane: tuple[
        ControlPlane, PoolClient, FakeClock]) -> None:
    cp, admin, clock = plane
    ran, waits = _history(cp, admin, clock)
    workload, config = workload_from_log(cp.app)
    by_id = {r.request_id: r for r in workload.requests}
    assert (by_id[ran].arrival, by_id[ran].runtime_seconds) == (0.0, 100.0)
    assert (by_id[waits].arrival, by_id[waits].runtime_seconds) == (30.0, 300.0)  # its bound
    assert by_id[ran].wide and by_id[ran].tenant == "alpha"
    assert [n.node_id for n in workload.nodes] == ["n1"]
    assert {t.name: t.weight for t in workload.tenants} == {"alpha": 1.0, "beta": 3.0}
    assert dict(config.priority_classes)["standard"] == 10


def test_pool_bench_policy_from_log_replays_through_every_policy(
        plane: tuple[ControlPlane, PoolClient, FakeClock],
        capsys: pytest.CaptureFixture[str]) -> None:
    cp, admin, clock = plane
    _history(cp, admin, clock)
    assert main(["bench", "policy", "--from-log", "--nats-url", cp.nats_url, "--json"]) == 0
    envelope = json.loads(capsys.readouterr().out)
    assert envelope["ok"] is True
    result = envelope["result"]
    assert result["requests"] == 2 and result["workload"].startswith("pool p1")
    for p in result["policies"]:
        assert p["waits"]["count"] == 2  # both ran in every replay


def test_a_log_with_nothing_to_replay_is_refused(
        plane: tuple[ControlPlane, PoolClient, FakeClock],
        capsys: pytest.CaptureFixture[str]) -> None:
    cp, _admin, _clock = plane
    with pytest.raises(NothingToReplay):
        workload_from_log(cp.app)
    assert main(["bench", "policy", "--from-log", "--pool", "nope", "--nats-url",
                 cp.nats_url]) != 0
    assert "--from-log" in capsys.readouterr().err
