"""A tenant cannot make the service publish anywhere but the tenant's own inbox: from its own
account its reply never reaches the plane's (ADR 027), and within the plane's account a reply
outside the requester's inbox is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from bus.admin import ensure_all_streams
from bus.local.auth import AuthConfig, inbox_prefix
from bus.local.server import NatsServer
from bus.replies import node_inbox, reply_allowed
from tests.security.conftest import service_url
from workers.plane import ControlPlane

# where a crafted reply would do harm: the log, a timer, a work queue, the leader KV, another
# tenant's inbox, the JetStream API
TARGETS = ["pool.evt.account.alpha", "pool.sched.lease.l1", "pool.agent.gpu-7.start",
           "$KV.pool_leader.scheduler", f"{inbox_prefix('beta')}.stolen", "$JS.API.STREAM.LIST"]


async def _attack(server: NatsServer, auth: AuthConfig) -> dict[str, Any]:
    svc = await nats.connect(service_url(server, auth))
    landed: list[str] = []

    async def watch(msg: Any) -> None:
        landed.append(msg.subject)

    for target in TARGETS:
        await svc.subscribe(target, cb=watch)
    await svc.flush()
    a = auth.tenants["alpha"]
    alpha = await nats.connect(server.url, user=a.user, password=a.password,
                               inbox_prefix=inbox_prefix("alpha").encode())
    for target in TARGETS:
        await alpha.publish("pool.cmd.alpha.lease.l1.get", b"{}", reply=target)
    # a reply subject that only looks like the tenant's inbox
    await alpha.publish("pool.cmd.alpha.lease.l1.get", b"{}", reply=inbox_prefix("alpha") + "x.1")
    await alpha.flush()
    # the tenant's own request is still answered, and is answered after the crafted ones
    own = await alpha.request("pool.cmd.alpha.lease.l1.get", b"{}", timeout=5)
    await asyncio.sleep(0.5)
    for c in (alpha, svc):
        await c.close()
    return {"landed": landed, "own": own.data}


def test_a_reply_subject_outside_the_tenants_inbox_lands_nowhere_in_the_plane(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    ensure_all_streams(service_url(server, auth))
    cp = ControlPlane(service_url(server, auth), roles=["commands"], data_plane=False).start()
    try:
        out = asyncio.run(_attack(server, auth))
        assert out["landed"] == []
        assert b"lease_not_found" in out["own"]
        # each crafted reply crossed into the plane's account as the server's own `_R_`
        # reply, so the plane answered it: back into alpha's own account, nowhere else
        assert cp.commands is not None and cp.commands.refused.count == 0
    finally:
        cp.stop()


@pytest.mark.parametrize(("subject", "reply", "allowed"), [
    ("pool.cmd.alpha.lease.l1.get", "_R_.aB3dEf.xY9zQw", True),
    ("pool.cmd.alpha.lease.l1.get", "_R_.aB3dEf.xY9zQw.TENANT_alpha.shash.T", True),
    ("pool.cmd.alpha.lease.l1.get", f"{inbox_prefix('alpha')}.r1", True),
    ("pool.cmd.alpha.lease.l1.get", f"{inbox_prefix('beta')}.r1", False),
    ("pool.cmd.alpha.lease.l1.get", "_R_", False),
    ("pool.cmd.alpha.lease.l1.get", "_R_.>", False),
    ("pool.cmd.alpha.lease.l1.get", "_R_.*.x", False),
    ("pool.cmd.alpha.lease.l1.get", "_R_..x", False),
    ("pool.cmd.alpha.lease.l1.get", "_R_x.a", False),
    ("pool.cmd.alpha.lease.l1.get", "pool.evt.account.alpha", False),
    # a node's report from its own account (ADR 028): the server's reply, as a tenant's
    ("pool.node.gpu-7.heartbeat", "_R_.aB3dEf.xY9zQw", True),
    ("pool.node.gpu-7.heartbeat", "_R_.>", False),
    ("pool.node.gpu-7.heartbeat", f"{node_inbox('gpu-7')}.r1", True),
    # the server's replies come from a tenant's or node's service import only: an operator
    # shares the plane's account, where a `_R_` reply is never named
    ("pool.admin.tenant.alpha", "_R_.aB3dEf.xY9zQw", False),
    ("pool.ops.queue", "_R_.aB3dEf.xY9zQw", False),
])
def test_a_servers_service_reply_is_answered_for_tenants_and_nodes_only(
        subject: str, reply: str, allowed: bool) -> None:
    assert reply_allowed(subject, reply) is allowed


def test_no_client_may_name_a_service_reply_itself(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    """The plane answers a `_R_` reply on a tenant's command: only the server names one (a
    client's publish with such a reply is a permissions violation, the operator's too), so
    such a reply always leads back to the tenant whose import it crossed."""
    server, auth = secured
    ensure_all_streams(service_url(server, auth))
    cp = ControlPlane(service_url(server, auth), roles=["commands"], data_plane=False).start()

    async def go() -> tuple[list[str], list[str]]:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        svc = await nats.connect(service_url(server, auth), error_cb=on_error)
        landed: list[str] = []

        async def watch(msg: Any) -> None:
            landed.append(msg.subject)

        await svc.subscribe("_R_.>", cb=watch)
        n = auth.nodes["gpu-7"]
        node = await nats.connect(server.url, user=n.user, password=n.password,
                                  inbox_prefix=node_inbox("gpu-7").encode(), error_cb=on_error)
        await node.publish("pool.node.gpu-7.heartbeat", b"{}", reply="_R_.aB3dEf.xY9zQw")
        await svc.publish("pool.cmd.alpha.lease.l1.get", b"{}", reply="_R_.aB3dEf.xY9zQw")
        for c in (node, svc):
            await c.flush()
        await asyncio.sleep(1)
        for c in (node, svc):
            await c.close()
        return landed, errors

    try:
        landed, errors = asyncio.run(go())
        assert landed == []
        assert sum("permissions violation" in e.lower() for e in errors) == 2, errors
    finally:
        cp.stop()
