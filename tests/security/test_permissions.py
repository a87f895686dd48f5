"""Least privilege, enforced by the server: the responders' user, hashed passwords, one table."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats

from bus.local.auth import (
    ROLES,
    AuthConfig,
    inbox_prefix,
    permission_matrix,
    url_with_credentials,
)
from bus.local.server import NatsServer
from tests.security.conftest import service_url
from workers.plane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ["pool.evt.account.alpha", "pool.sched.lease.l1", "pool.agent.gpu-7.start",
             "$KV.pool_leader.scheduler", "$JS.API.STREAM.LIST", "pool.cmd.alpha.lease.request"]


async def _responder_publishes(server: NatsServer, auth: AuthConfig) -> dict[str, Any]:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    watcher = await nats.connect(service_url(server, auth))
    landed: list[str] = []

    async def watch(msg: Any) -> None:
        landed.append(msg.subject)

    for subject in [*FORBIDDEN, f"{inbox_prefix('alpha')}.>"]:
        await watcher.subscribe(subject, cb=watch)
    await watcher.flush()
    r = auth.responder
    responder = await nats.connect(server.url, user=r.user, password=r.password,
                                   error_cb=on_error)
    for subject in FORBIDDEN:
        await responder.publish(subject, b'{"ok": true}')
    await responder.publish(f"{inbox_prefix('alpha')}.x.1", b'{"ok": true}')  # a reply: allowed
    await responder.flush()
    await asyncio.sleep(0.5)
    for c in (responder, watcher):
        await c.close()
    return {"landed": landed, "errors": errors}


def test_the_responders_user_can_publish_replies_and_nothing_else(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    out = asyncio.run(_responder_publishes(*secured))
    assert out["landed"] == [f"{inbox_prefix('alpha')}.x.1"]
    assert sum("permissions violation" in e.lower() for e in out["errors"]) == len(FORBIDDEN)


def test_the_command_service_answers_tenants_as_the_responders_user(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    from bus.admin import ensure_all_streams
    from client.api import PoolClient

    ensure_all_streams(service_url(server, auth))
    cp = ControlPlane(service_url(server, auth), roles=["commands"], data_plane=False,
                      responder_url=url_with_credentials(server.url, auth.responder)).start()
    try:
        a = auth.tenants["alpha"]
        with PoolClient(server.url, "alpha", user=a.user, password=a.password) as alpha:
            got = alpha.call("pool.cmd.alpha.lease.l1.get")
        assert got["error"]["code"] == "lease_not_found", got
    finally:
        cp.stop()


def test_the_servers_configuration_holds_bcrypt_hashes_not_passwords(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    rendered = auth.render()
    everyone = [auth.service, auth.responder, *auth.tenants.values(), *auth.nodes.values()]
    for c in everyone:
        assert c.password not in rendered
    assert auth.guard.password not in rendered
    accounts = json.loads(rendered.removeprefix("accounts: "))
    users = [u for a in accounts.values() for u in a["users"]]
    assert len(users) == 3 + len(ROLES) + len(auth.tenants) + len(auth.nodes)  # + the guard
    assert all(str(u["password"]).startswith("$2b$") for u in users)

    async def connects() -> bool:  # the server checks a plain password against its hash
        t = auth.tenants["beta"]
        nc = await nats.connect(server.url, user=t.user, password=t.password)
        await nc.close()
        return True

    assert asyncio.run(connects())


def test_the_permission_matrix_in_the_docs_is_the_one_in_code() -> None:
    assert permission_matrix() in (ROOT / "docs" / "security.md").read_text()
