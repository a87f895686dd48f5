"""Retries as the scheduler places them, on a hand-driven plane: a retry keeps off the node
its last attempt ended on while another fits, and its job restarts without a commit."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from chaos.invariants import check_workflows
from client.api import PoolClient
from domain.lease import Lease
from tests.control_plane import Plane, lease_body, node_body, node_report, setup_pool


def test_a_retry_avoids_the_node_its_attempt_failed_on_unless_nothing_else_fits(
        plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    # best-fit puts a 1,000-millicore lease on the smaller node first
    admin.admin("node.register", node_body("small", cpu_millis=2000))
    admin.admin("node.register", node_body("big", cpu_millis=8000))
    body = lease_body("flaky", cpu_millis=1000) | {
        "retries": {"max_attempts": 3, "on": ["failed"]}}
    with PoolClient(cp.nats_url, "alpha") as a:
        lid = a.request_lease(body)["lease"]["lease_id"]
        cp.scheduler.cycle()
        assert a.lease(lid, "get")["lease"]["node_id"] == "small"
        assert a.lease(lid, "commit", {"job": {"command": ["false"]}})["ok"]
        assert node_report(cp.nats_url, "small", lid, "exited",
                           {"epoch": 1, "exit_code": 1})["ok"]
        lease = a.lease(lid, "get")["lease"]
        assert (lease["state"], lease["attempts"]) == ("queued", 2)
        cp.scheduler.cycle()
        lease = a.lease(lid, "get")["lease"]
        # placed away from the node it failed on, and its job restarted on its own
        assert (lease["state"], lease["node_id"], lease["epoch"]) == ("running", "big", 2)
        assert node_report(cp.nats_url, "big", lid, "exited",
                           {"epoch": 2, "exit_code": 1})["ok"]
        assert admin.admin("node.small.cordon", {"reason": "test"})["ok"]
        cp.scheduler.cycle()
        lease = a.lease(lid, "get")["lease"]
        # nothing else fits: back on the node it failed on last
        assert (lease["node_id"], lease["attempts"]) == ("big", 3)
        assert [e["node_id"] for e in lease["attempt_ends"]] == ["small", "big"]


def _until(what: Callable[[], Any], want: Any, seconds: float = 15) -> Any:
    deadline = time.monotonic() + seconds
    while (got := what()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_after_each_starts_each_index_after_its_pair(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1"))  # 8 cores: both arrays fit at once
    with PoolClient(cp.nats_url, "alpha") as a:
        first = a.request_lease(lease_body("first", cpu_millis=400) | {"count": 10})
        firsts = first["result"]["lease_ids"]
        second = a.request_lease(lease_body("second", cpu_millis=400) | {
            "count": 10, "after_each": {"lease_id": firsts[0], "condition": "ok"}})
        seconds = second["result"]["lease_ids"]

        def states() -> list[str]:
            return [a.lease(i, "get")["lease"]["state"] for i in seconds]

        assert states() == ["held"] * 10
        cp.scheduler.cycle()
        for lid in firsts:
            assert a.lease(lid, "commit", {})["ok"]
        # index 0 fails, 1 to 4 succeed: only their pairs move; 5 to 9 still wait
        assert a.lease(firsts[0], "release", {"exit_code": 3})["ok"]
        for lid in firsts[1:5]:
            assert a.lease(lid, "release", {"exit_code": 0})["ok"]
        want = ["rejected"] + ["queued"] * 4 + ["held"] * 5
        assert _until(states, want) == want
        assert a.lease(seconds[0], "get")["lease"]["end_reason"] == "dependency_failed"
        cp.scheduler.cycle()
        assert states() == ["rejected"] + ["reserved"] * 4 + ["held"] * 5
        for lid in firsts[5:]:
            assert a.lease(lid, "release", {"exit_code": 0})["ok"]
        want = ["rejected"] + ["reserved"] * 4 + ["queued"] * 5
        assert _until(states, want) == want
        cp.scheduler.cycle()
        assert states() == ["rejected"] + ["reserved"] * 9
        # from the log: each was reserved only after its pair had succeeded
        report = check_workflows(cp.app)
        assert (report.dependents_placed, report.early_starts) == (9, []), report
        # an array of another size, or no array's first lease, is refused
        other = a.request_lease(lease_body("third", cpu_millis=500) | {
            "count": 2, "after_each": {"lease_id": firsts[0]}})
        assert other["error"]["code"] == "unknown_dependency"


def test_a_lease_cannot_wait_for_itself_so_no_cycle_forms(plane: Plane) -> None:
    """Ids follow from the tenant and the idempotency key, so a request can name its own id
    (or its array's) before it exists: that is refused, as any lease not made yet is."""
    cp, admin, _clock = plane
    setup_pool(admin)
    with PoolClient(cp.nats_url, "alpha") as a:
        own = str(Lease.create_id("alpha", "loop"))
        for field in ({"after": [{"lease_id": own}]},
                      {"count": 2, "after_each": {"lease_id": own}}):
            refused = a.request_lease(lease_body("loop") | field)
            assert refused["error"]["code"] == "unknown_dependency", refused
        assert a.lease(own, "get")["error"]["code"] == "lease_not_found"
        # B after A, then A again (its key) made to wait for B: A is already made, and stays
        lead = a.request_lease(lease_body("a"))["lease"]["lease_id"]
        b = a.request_lease(lease_body("b") | {"after": [{"lease_id": lead}]})["lease"]
        again = a.request_lease(lease_body("a") | {"after": [{"lease_id": b["lease_id"]}]})
        assert again["error"]["code"] == "idempotency_conflict", again
        assert a.lease(lead, "get")["lease"]["after"] == []

def test_another_tenant_s_lease_cannot_be_waited_for(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        theirs = a.request_lease(lease_body("alpha-1"))["lease"]["lease_id"]
        for field in ({"after": [{"lease_id": theirs}]}, {"after_each": {"lease_id": theirs}}):
            refused = b.request_lease(lease_body("beta-1") | field)
            assert refused["error"]["code"] == "unknown_dependency", refused
            assert "alpha" not in refused["error"]["message"]  # nothing of the other tenant
