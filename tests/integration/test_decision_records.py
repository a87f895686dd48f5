"""`pool lease why ID --at TIME`: the scheduler records a waiting lease's reasons when they
change (in POOL_DECISIONS, not the log), and `why --at` answers what was recorded then."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from bus.decisions import DecisionReader
from bus.local.server import NatsServer
from cli.main import main
from client.api import PoolClient
from tests.control_plane import Plane, lease_body, node_body, setup_pool
from workers.scheduler.decisions import DecisionRecorder


def _iso(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat()


def _why_at(capsys: pytest.CaptureFixture[str], url: str, tenant: str, lid: str,
            at: float) -> dict[str, Any]:
    capsys.readouterr()
    rc = main(["lease", "why", lid, "--at", _iso(at), "--tenant", tenant, "--nats-url", url,
               "--json"])
    reply: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert (rc == 0) == bool(reply.get("ok")), reply
    return reply


def test_why_at_answers_the_reason_recorded_at_each_time(
        plane: Plane, fresh_nats: NatsServer, capsys: pytest.CaptureFixture[str]) -> None:
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    assert admin.admin("node.register", node_body("n1", cpu_millis=4000))["ok"]
    assert cp.scheduler.decisions is not None
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        b.request_lease(lease_body("big", cpu_millis=4000))
        assert cp.scheduler.cycle().placed == 1
        requested = clock.now
        lid = a.request_lease(lease_body("wide", cpu_millis=2000))["lease"]["lease_id"]
        clock.advance(5)
        t_capacity = clock.now
        assert cp.scheduler.cycle().placed == 0  # n1 is full: waiting for capacity
        written = cp.scheduler.decisions.written
        clock.advance(5)
        assert cp.scheduler.cycle().placed == 0  # nothing changed: nothing recorded
        assert cp.scheduler.decisions.written == written
        clock.advance(5)
        # a second node, but alpha's quota now keeps the lease out
        assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                          "quota": {"cpu_millis": 1000}})["ok"]
        assert admin.admin("node.register", node_body("n2", cpu_millis=4000))["ok"]
        t_quota = clock.now
        assert cp.scheduler.cycle().placed == 0
        clock.advance(5)
        assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                          "quota": {"cpu_millis": 8000}})["ok"]
        t_placed = clock.now
        assert cp.scheduler.cycle().placed == 1

        url = fresh_nats.url
        first = _why_at(capsys, url, "alpha", lid, t_capacity + 2)["result"]
        assert first["waiting"] and first["recorded_at"] == t_capacity
        assert first["reasons"]["tenant"] == ["waiting_for_capacity"]
        second = _why_at(capsys, url, "alpha", lid, t_quota + 2)["result"]
        assert second["waiting"] and second["recorded_at"] == t_quota
        assert second["reasons"]["tenant"] == ["quota_exceeded"]
        third = _why_at(capsys, url, "alpha", lid, t_placed + 2)["result"]
        assert not third["waiting"] and third["state"] == "reserved"
        assert third["record"]["node_id"] == "n2"
        assert third["record"]["terms"]["priority_class"] == "standard"
        assert third["record"]["terms"]["waited_seconds"] == pytest.approx(t_placed - requested)
        before = _why_at(capsys, url, "alpha", lid, requested - 3600)["result"]
        assert not before["waiting"] and before["state"] == "not_requested"
        # another tenant asking about alpha's lease learns nothing of it
        other = b.lease(lid, "why", {"at": t_quota + 2})
        assert not other["ok"] and other["error"]["code"] == "lease_not_found"
        # and the records are not in the event log
        assert len(DecisionReader(url).records("alpha", lid)) == 3


class _Counting:
    def __init__(self) -> None:
        self.batches: list[int] = []

    def append(self, records: list[tuple[str, str, bytes]]) -> None:
        self.batches.append(len(records))


def test_a_queue_of_2000_writes_at_most_the_bound_a_cycle_and_nothing_unchanged(
        plane: Plane) -> None:
    cp, admin, clock = plane
    setup_pool(admin, credits=10**15)
    assert admin.admin("node.register", node_body("n1", cpu_millis=1000))["ok"]
    writer = _Counting()
    cp.scheduler.decisions = DecisionRecorder(writer, max_per_cycle=500)
    with PoolClient(cp.nats_url, "alpha") as a:
        for i in range(3):  # an array request of 999, 999 and 3: 2,001 leases
            n = (999, 999, 3)[i]
            got = a.request_lease(lease_body(f"q{i}", cpu_millis=1000) | {"count": n})
            assert got["ok"], got
    clock.advance(1)
    assert cp.scheduler.cycle().placed == 1  # the rest (2,000) wait for capacity
    assert writer.batches == [500]  # 500 of the waits (the lease placed at once never waited)
    for _ in range(4):
        clock.advance(1)
        cp.scheduler.cycle()
    assert writer.batches == [500, 500, 500, 500]
    assert cp.scheduler.decisions.pending == 0
    clock.advance(1)
    cp.scheduler.cycle()  # nothing changed: nothing written
    assert writer.batches == [500, 500, 500, 500]
