"""What one NATS connection may hold, enforced by the server: a tenant subscribing past the cap
is refused (and its client closes), while another tenant subscribes and hears as before."""

from __future__ import annotations

import asyncio
from typing import Any

import nats

from bus.local.auth import AuthConfig
from bus.local.server import MAX_SUBSCRIPTIONS_PER_CONNECTION, NatsServer


async def _subscribe_past_the_cap(server: NatsServer, auth: AuthConfig) -> dict[str, Any]:
    def connect(tenant: str) -> Any:
        c = auth.tenants[tenant]
        return nats.connect(server.url, user=c.user, password=c.password,
                            allow_reconnect=False, max_reconnect_attempts=0)

    greedy, other = await connect("alpha"), await connect("beta")
    for i in range(MAX_SUBSCRIPTIONS_PER_CONNECTION):
        await greedy.subscribe(f"pool.tel.p1.n1.alpha.l{i}.output")
    await greedy.flush(5)
    at_the_cap = greedy.is_connected
    await greedy.subscribe("pool.tel.p1.n1.alpha.one-more.output")
    for _ in range(50):  # the server's -ERR arrives asynchronously
        if greedy.is_closed:
            break
        await asyncio.sleep(0.05)
    heard: list[str] = []
    sub = await other.subscribe("pool.tel.p1.n1.beta.>")
    await other.flush(5)
    publisher = await nats.connect(server.url, user=auth.service.user,
                                   password=auth.service.password)
    await publisher.publish("pool.tel.p1.n1.beta.l1.output", b"x")
    await publisher.flush(5)
    msg = await sub.next_msg(timeout=5)
    heard.append(msg.subject)
    out = {"at_the_cap": at_the_cap, "closed": greedy.is_closed,
           "error": repr(greedy.last_error), "heard": heard}
    for c in (other, publisher):
        await c.close()
    return out


def test_a_tenant_subscribing_past_the_cap_is_refused_and_another_is_not(
        tmp_path: Any) -> None:
    auth = AuthConfig()
    for tenant in ("alpha", "beta"):
        auth.add_tenant(tenant)
    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-limits",
                    extra_config=auth.render()) as server:
        out = asyncio.run(_subscribe_past_the_cap(server, auth))
        log = server.log_path.read_text()
    assert out["at_the_cap"] and out["closed"], out
    assert "maximum subscriptions exceeded" in (out["error"] + log).lower(), out
    assert "user:tenant-alpha" in log and out["heard"] == ["pool.tel.p1.n1.beta.l1.output"]


def test_the_embedded_server_sets_the_connection_limits() -> None:
    from pathlib import Path

    config = NatsServer(store_dir=Path("/nonexistent")).render_config()
    assert f"max_subscriptions: {MAX_SUBSCRIPTIONS_PER_CONNECTION}" in config
    assert "max_pending: 67108864" in config and "max_payload: 1048576" in config
    compose = (Path(__file__).resolve().parents[2] / "deploy" / "nats" / "nats.conf").read_text()
    assert f"max_subscriptions: {MAX_SUBSCRIPTIONS_PER_CONNECTION}" in compose
