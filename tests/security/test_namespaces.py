"""A tenant and a node of the same name share nothing: not an inbox, not a user."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from bus.agentbus import AgentLink, ControlLink
from bus.errors import NameCollision
from bus.local.auth import AuthConfig, inbox_prefix, url_with_credentials
from bus.local.server import NatsServer
from tests.security.conftest import service_url


async def _snoop(server: NatsServer, auth: AuthConfig, prefix: str,
                 seen: list[bytes], errors: list[str], ready: asyncio.Event,
                 done: asyncio.Event) -> None:
    t = auth.tenants["gpu-7"]

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    async def on_msg(msg: Any) -> None:
        seen.append(bytes(msg.data))

    tenant = await nats.connect(server.url, user=t.user, password=t.password,
                                inbox_prefix=inbox_prefix("gpu-7").encode(), error_cb=on_error)
    await tenant.subscribe(f"{prefix}.>", cb=on_msg)
    await tenant.flush()
    ready.set()
    await done.wait()
    await asyncio.sleep(0.3)
    await tenant.close()


def test_a_tenant_named_like_a_node_cannot_read_its_work_orders(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    control = ControlLink(service_url(server, auth))
    control.ensure_streams()
    control.ensure_agent_consumer("gpu-7")
    control.send("gpu-7", "start", b'{"env": {"SECRET": "of-another-tenant"}}', msg_id="o1")
    n = auth.nodes["gpu-7"]
    link = AgentLink(url_with_credentials(server.url, n), "gpu-7").connect()
    # the tenant subscribes under whatever prefix the node's own connection uses
    prefix = link._nc._inbox_prefix.decode()  # the node connection's real inbox
    seen: list[bytes] = []
    errors: list[str] = []

    async def scenario() -> None:
        ready, done = asyncio.Event(), asyncio.Event()
        snoop = asyncio.create_task(_snoop(server, auth, prefix, seen, errors, ready, done))
        await ready.wait()
        orders = await asyncio.to_thread(link.fetch, 16, 3.0)
        assert [o.verb for o in orders] == ["start"]  # the node itself gets its order
        done.set()
        await snoop

    try:
        asyncio.run(scenario())
    finally:
        link.close()
        control.close()
    assert seen == []
    assert any("permissions violation" in e.lower() for e in errors), errors


async def _forge(server: NatsServer, auth: AuthConfig) -> dict[str, Any]:
    t, n = auth.tenants["gpu-7"], auth.nodes["gpu-7"]
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    tenant = await nats.connect(server.url, user=t.user, password=t.password,
                                inbox_prefix=inbox_prefix("gpu-7").encode())
    got: list[bytes] = []

    async def on_msg(msg: Any) -> None:
        got.append(bytes(msg.data))

    await tenant.subscribe(f"{inbox_prefix('gpu-7')}.>", cb=on_msg)
    await tenant.flush()
    node = await nats.connect(server.url, user=n.user, password=n.password, error_cb=on_error)
    await node.publish(f"{inbox_prefix('gpu-7')}.forged", b'{"ok": true, "lease": "fake"}')
    await node.flush()
    await asyncio.sleep(0.3)
    for c in (tenant, node):
        await c.close()
    return {"got": got, "errors": errors}


def test_a_node_cannot_forge_replies_into_the_inbox_of_a_tenant_of_its_name(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    out = asyncio.run(_forge(*secured))
    assert out["got"] == []
    assert any("permissions violation" in e.lower() for e in out["errors"]), out["errors"]


@pytest.mark.parametrize("name", ["Alpha", "al.pha", "al pha", "", "x" * 129, "al*"])
def test_a_name_that_would_fold_onto_another_is_refused_with_a_code(name: str) -> None:
    auth = AuthConfig()
    auth.add_tenant("alpha")
    with pytest.raises(NameCollision) as e:
        auth.add_tenant(name)
    assert e.value.code == "name_collision"
    with pytest.raises(NameCollision):
        auth.add_node(name)
    assert list(auth.tenants) == ["alpha"] and auth.nodes == {}
