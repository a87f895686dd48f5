"""Tenants stay in their lane: the server itself refuses cross-tenant commands and replies."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bus.local.auth import AuthConfig, inbox_prefix
from bus.local.server import NatsServer


@pytest.fixture()
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, AuthConfig]]:
    auth = AuthConfig()
    auth.add_tenant("alpha")
    auth.add_tenant("beta")
    server = NatsServer(store_dir=tmp_path, server_name="pool-auth", extra_config=auth.render())
    server.start()
    yield server, auth
    server.stop()


async def _scenario(server: NatsServer, auth: AuthConfig) -> dict[str, object]:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    svc = await nats.connect(server.url, user=auth.service.user, password=auth.service.password)
    seen: list[str] = []

    async def answer(msg: nats.aio.msg.Msg) -> None:
        seen.append(msg.subject)
        await msg.respond(b"secret-for-" + msg.subject.split(".")[2].encode())

    await svc.subscribe("pool.cmd.*.lease.>", cb=answer)
    await svc.flush()

    a = auth.tenants["alpha"]
    alpha = await nats.connect(
        server.url, user=a.user, password=a.password,
        inbox_prefix=inbox_prefix("alpha").encode(), error_cb=on_error,
    )
    own = await alpha.request("pool.cmd.alpha.lease.request", b"{}", timeout=2)

    # acting as beta: the server drops the publish, so no service ever sees it
    await alpha.publish("pool.cmd.beta.lease.l1.release", b"{}")
    await alpha.flush()

    # reading beta's replies: the subscription is refused
    b = auth.tenants["beta"]
    beta = await nats.connect(
        server.url, user=b.user, password=b.password, inbox_prefix=inbox_prefix("beta").encode()
    )
    snooped: list[bytes] = []

    async def snoop(msg: nats.aio.msg.Msg) -> None:
        snooped.append(msg.data)

    await alpha.subscribe(f"{inbox_prefix('beta')}.>", cb=snoop)
    await alpha.flush()
    beta_reply = await beta.request("pool.cmd.beta.lease.request", b"{}", timeout=2)
    await asyncio.sleep(0.3)
    for c in (alpha, beta, svc):
        await c.close()
    return {"own": own.data, "beta": beta_reply.data, "seen": seen, "errors": errors,
            "snooped": snooped}


def test_a_tenant_cannot_act_as_another_nor_read_its_replies(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    out = asyncio.run(_scenario(*secured))
    assert out["own"] == b"secret-for-alpha"
    assert out["beta"] == b"secret-for-beta"
    assert "pool.cmd.beta.lease.l1.release" not in out["seen"]
    assert out["snooped"] == []
    assert sum("permissions violation" in e.lower() for e in out["errors"]) >= 2, out["errors"]
