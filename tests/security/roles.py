"""A control plane whose every role connects as its own user, and a lease's whole life on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.simulate import SleepRuntime
from bus.agentbus import AgentLink
from bus.local.auth import AuthConfig, role_urls, url_with_credentials
from bus.local.server import NatsServer
from bus.replies import tenant_inbox
from client.api import PoolClient
from tests.control_plane import lease_body
from workers.plane import ControlPlane

PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)
VIOLATION = "Permissions Violation"


def wait_for(what: Callable[[], Any], timeout: float = 20.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def violations(server: NatsServer) -> list[str]:
    """The permission violations the server logged, one line each."""
    return [line for line in server.log_path.read_text(errors="replace").splitlines()
            if VIOLATION in line]


@contextmanager
def secured_plane(tmp_path: Path, database_url: str | None = None, *,
                  extra_config: str = "") -> Iterator[tuple[NatsServer, AuthConfig,
                                                            ControlPlane]]:
    """A server with every user on, the streams made by the operator, and a control plane
    whose roles connect as their own users (as `pool up` runs it)."""
    from bus.admin import ensure_all_streams

    auth = AuthConfig()
    for tenant in ("alpha", "beta"):
        auth.add_tenant(tenant)
    auth.add_node("n1")
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-roles",
                        extra_config=auth.render() + extra_config).start()
    try:
        ensure_all_streams(url_with_credentials(server.url, auth.service))
        cp = ControlPlane(url_with_credentials(server.url, auth.roles["commands"]),
                          database_url=database_url, leader_ttl_seconds=1.0,
                          role_urls=role_urls(server.url, auth),
                          responder_url=url_with_credentials(server.url, auth.responder)).start()
        try:
            yield server, auth, cp
        finally:
            cp.stop()
    finally:
        server.stop()


def admin_client(server: NatsServer, auth: AuthConfig) -> PoolClient:
    return PoolClient(url_with_credentials(server.url, auth.roles["admin"]), timeout=15)


def tenant_client(server: NatsServer, auth: AuthConfig, tenant: str) -> PoolClient:
    c = auth.tenants[tenant]
    return PoolClient(server.url, tenant, user=c.user, password=c.password, timeout=15,
                      inbox_prefix=tenant_inbox(tenant).encode())


def lease_lifecycle(server: NatsServer, auth: AuthConfig, state: Path) -> dict[str, str]:
    """Everything the roles do for a lease: a pool and a tenant set up by the admin CLI, an
    enrolled node whose agent runs a job (dispatcher orders, node reports), one lease run to
    its release, one reservation voided by its timer (reconciler), a `why` and a `why --at`
    (scheduler)."""
    with admin_client(server, auth) as admin:
        assert admin.admin("pool.set", {"pool_id": "p1", "commit_timeout_seconds": 1,
                                        "heartbeat_timeout_seconds": 2,
                                        "node_timeout_seconds": 3,
                                        "priority_classes": {"standard": 10}})["ok"]
        assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                          "weight": 1.0})["ok"]
        assert admin.admin("credits.grant", {"tenant": "alpha", "amount_microcredits": 10**12,
                                             "transfer_id": "initial-alpha"})["ok"]
        assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
        node = auth.nodes["n1"]
        link = AgentLink(url_with_credentials(server.url, node), "n1").connect()
        agent = Agent(link, SleepRuntime(), node_id="n1", pool_id="p1", probe=PROBE,
                      state_dir=state, reserve=Reserve(500, 1024, 0), heartbeat_interval=0.5)
        stop = threading.Event()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        out: dict[str, str] = {}
        try:
            with tenant_client(server, auth, "alpha") as alpha:
                def state_of(lid: str) -> str:
                    return str(alpha.lease(lid, "get")["lease"]["state"])

                ran = alpha.request_lease(lease_body("ran", runtime="sandboxed",
                                                     memory_mib=256))["lease"]["lease_id"]
                wait_for(lambda: state_of(ran) == "reserved")
                assert alpha.lease(ran, "why")["ok"]
                # what the scheduler recorded (a rejection), written and read back as its
                # own user
                wide = alpha.request_lease(lease_body("wide", runtime="sandboxed",
                                                      cpu_millis=512_000))["lease"]["lease_id"]
                wait_for(lambda: alpha.lease(wide, "why", {"at": time.time()}).get(
                    "result", {}).get("state") == "rejected")
                assert alpha.lease(ran, "commit", {"job": {
                    "image": "local/job@sha256:" + "a" * 64,
                    "command": ["sleep", "1"]}})["ok"]
                wait_for(lambda: state_of(ran) == "released")
                out["ran"] = state_of(ran)
                # the lease feed: written by the dispatcher, read back by the command service
                wait_for(lambda: alpha.call("pool.cmd.alpha.feed.replay", {}).get("ok")
                         and alpha.call("pool.cmd.alpha.feed.replay", {})["result"]["records"])
                voided = alpha.request_lease(lease_body("voided", runtime="sandboxed",
                                                        memory_mib=256))["lease"]["lease_id"]
                wait_for(lambda: state_of(voided) == "reserved")
                time.sleep(2.5)  # past the commit timeout: the reconciler's timer voids it
                wait_for(lambda: state_of(voided) not in ("queued", "reserved"))
                out["voided"] = state_of(voided)
                silent = alpha.request_lease(lease_body("silent", runtime="sandboxed",
                                                        memory_mib=256))["lease"]["lease_id"]
                wait_for(lambda: state_of(silent) == "reserved")
                assert alpha.lease(silent, "commit", {"job": {
                    "image": "local/job@sha256:" + "a" * 64,
                    "command": ["sleep", "600"]}})["ok"]
                wait_for(lambda: state_of(silent) == "running")
                # the agent falls silent without a word: the reconciler's timers expire the
                # lease and mark the node
                agent.deregister = lambda: None  # type: ignore[method-assign]
                stop.set()
                thread.join(15)
                wait_for(lambda: state_of(silent) != "running")
                out["silent"] = state_of(silent)
        finally:
            stop.set()
            thread.join(15)
            link.close()
    return out
