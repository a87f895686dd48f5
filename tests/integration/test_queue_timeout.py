"""A queued lease does not wait for ever: past its queue timeout (the request's, at most the
pool's) its deadline timer ends it `queue_timeout`. A real plane on a real clock, so the timer
is a real JetStream scheduled message fired by the server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, node_body, setup_pool
from workers.plane import ControlPlane


def _wait_for(what: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_lease_queued_past_its_queue_timeout_ends_queue_timeout(
        fresh_nats: NatsServer) -> None:
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    try:
        with PoolClient(fresh_nats.url) as admin, PoolClient(fresh_nats.url, "alpha") as alpha:
            setup_pool(admin, commit_timeout_seconds=600, queue_timeout_seconds=3)
            assert admin.admin("node.register", node_body("n1"))["ok"]

            def lease(lid: str) -> dict[str, Any]:
                got: dict[str, Any] = alpha.lease(lid, "get")["lease"]
                return got

            # the node's whole capacity, held uncommitted: everything after it waits
            holder = alpha.request_lease(lease_body("holder", cpu_millis=8000))
            hid = holder["lease"]["lease_id"]
            _wait_for(lambda: lease(hid)["state"] == "reserved")
            asks = {"short": 1, "pool's": None, "longer than the pool's": 3600}
            ids = {}
            for name, seconds in asks.items():
                body = lease_body(name.replace(" ", "-").replace("'", ""), cpu_millis=8000)
                if seconds is not None:
                    body["queue_timeout_seconds"] = seconds
                r = alpha.request_lease(body)
                assert r["ok"] and r["lease"]["state"] == "queued", r
                ids[name] = r["lease"]["lease_id"]
            asked = time.monotonic()
            _wait_for(lambda: lease(ids["short"])["state"] == "rejected")
            assert lease(ids["short"])["end_reason"] == "queue_timeout"
            assert lease(ids["pool's"])["state"] == "queued"  # 3 s, not 1
            for name in ("pool's", "longer than the pool's"):  # at most the pool's 3 s
                _wait_for(lambda n=name: lease(ids[n])["state"] == "rejected")
                assert lease(ids[name])["end_reason"] == "queue_timeout"
            assert time.monotonic() - asked < 15
            assert lease(hid)["state"] == "reserved"  # placed leases are not timed by it
    finally:
        cp.stop()
