"""The operator's questions for the scheduler (`pool.ops.…`, e.g. `pool shares`): answered to the
admin user as every role runs as its own, and refused by the server to a tenant's credentials."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.errors import BusError
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.replies import tenant_inbox
from cli.main import main
from tests.security.roles import admin_client, secured_plane, tenant_client, violations, wait_for

SHARES = "pool.ops.pool.shares"


def test_the_admin_asks_the_running_scheduler_for_shares_and_a_tenant_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with secured_plane(tmp_path) as (server, auth, _cp):
        with admin_client(server, auth) as admin:
            assert admin.admin("pool.set", {"pool_id": "p1"})["ok"]
            assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                              "weight": 2.0})["ok"]

            def answered() -> dict[str, Any] | None:
                got: dict[str, Any] = admin.call(SHARES, {"pool_id": "p1"})
                rows = (got.get("result") or {}).get("tenants") or []
                return got if any(r["tenant"] == "alpha" for r in rows) else None

            got = wait_for(answered)
            assert got["ok"] and got["result"]["pool_id"] == "p1"
        # `pool shares` as the admin CLI runs it: its own user, nothing read from the log here
        admin_url = url_with_credentials(server.url, auth.roles["admin"])
        assert main(["shares", "p1", "--nats-url", admin_url, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["result"]["tenants"]
        assert [(r["tenant"], r["weight"]) for r in rows] == [("alpha", 2.0)]
        assert violations(server) == []  # asked, answered and replied within every rule
        with tenant_client(server, auth, "alpha") as alpha:
            alpha.timeout = 1.0
            with pytest.raises(BusError):  # no scheduler hears it, so nothing answers
                alpha.call(SHARES, {"pool_id": "p1"})
        out = asyncio.run(_tenant_asks(server, auth))
        assert out == {"landed": [], "refused": 1}


async def _tenant_asks(server: NatsServer, auth: AuthConfig) -> dict[str, Any]:
    """Tenant alpha's own user publishes the question; what landed (seen by the operator's
    user) and how many publishes the server refused."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    watcher = await nats.connect(url_with_credentials(server.url, auth.service))
    landed: list[str] = []

    async def watch(msg: Any) -> None:
        landed.append(msg.subject)

    await watcher.subscribe("pool.ops.>", cb=watch)
    await watcher.flush()
    a = auth.tenants["alpha"]
    nc = await nats.connect(server.url, user=a.user, password=a.password, error_cb=on_error,
                            max_reconnect_attempts=0)
    await nc.publish(SHARES, b'{"pool_id": "p1"}', reply=f"{tenant_inbox('alpha')}.x")
    await nc.flush()
    await asyncio.sleep(0.5)
    for conn in (nc, watcher):
        await conn.close()
    return {"landed": landed,
            "refused": sum("permissions violation" in e.lower() for e in errors)}
