"""A tenant cannot make the service publish anywhere but the tenant's own inbox."""

from __future__ import annotations

import asyncio
from typing import Any

import nats

from bus.admin import ensure_all_streams
from bus.local.auth import AuthConfig, inbox_prefix
from bus.local.server import NatsServer
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


def test_a_reply_subject_outside_the_tenants_inbox_gets_no_answer(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    ensure_all_streams(service_url(server, auth))
    cp = ControlPlane(service_url(server, auth), roles=["commands"], data_plane=False).start()
    try:
        out = asyncio.run(_attack(server, auth))
        assert out["landed"] == []
        assert b"lease_not_found" in out["own"]
        assert cp.commands is not None and cp.commands.refused.count == len(TARGETS) + 1
    finally:
        cp.stop()
