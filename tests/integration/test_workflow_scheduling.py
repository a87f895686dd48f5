"""Retries as the scheduler places them, on a hand-driven plane: a retry keeps off the node
its last attempt ended on while another fits, and its job restarts without a commit."""

from __future__ import annotations

from client.api import PoolClient
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
