"""A node agent's NATS user holds at most its caps of connections and subscriptions, as a
tenant's does: its account's limits (ADR 028) refuse the connection or subscription past them
at the server, and the connection guard (ADR 023) closes what gets past them on any server. A
compromised node cannot take the server's memory and descriptors without bound."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.caps import Caps, InvalidLimit
from bus.connguard import ConnectionGuard, user_caps
from bus.local import auth as bus_auth
from bus.local.accounts import node_account
from bus.local.auth import AuthConfig, guard_url, url_with_credentials
from bus.local.server import NatsServer
from bus.replies import node_inbox


def _auth() -> AuthConfig:
    auth = AuthConfig()
    auth.add_tenant("alpha")
    for node in ("n1", "n2"):
        auth.add_node(node)
    return auth


@pytest.fixture()
def plane(tmp_path: Path) -> Iterator[tuple[NatsServer, AuthConfig]]:
    """Nodes n1 and n2 under the default caps (their accounts' limits)."""
    auth = _auth()
    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-node-caps",
                    extra_config=auth.render()) as server:
        yield server, auth


async def _quiet(_e: Exception) -> None:
    pass


async def _connect(server: NatsServer, auth: AuthConfig, node: str) -> Any:
    return await nats.connect(url_with_credentials(server.url, auth.nodes[node]),
                              inbox_prefix=node_inbox(node).encode(), error_cb=_quiet,
                              allow_reconnect=False, max_reconnect_attempts=0)


async def _closed_within(conns: list[Any], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(c.is_closed for c in conns):
        await asyncio.sleep(0.05)


async def _answers(conns: list[Any], node: str) -> list[bool]:
    """Whether each of `conns` still subscribes and hears its node's agent orders."""
    heard = []
    for i, c in enumerate(conns):
        try:
            sub = await c.subscribe(f"pool.agent.{node}.probe{i}")
            await c.flush(5)
            await c.publish(f"pool.node.{node}.probe", b"")  # a publish its rule allows
            await c.flush(5)
            heard.append(sub is not None and c.is_connected)
        except Exception:  # noqa: BLE001 - not answering is the answer
            heard.append(False)
    return heard


def test_the_default_node_caps_are_rendered_as_each_node_s_account_limits() -> None:
    accounts = json.loads(_auth().render().removeprefix("accounts: "))
    for node in ("n1", "n2"):
        assert accounts[node_account(node)]["limits"] == {"max_connections": 8,
                                                          "max_subscriptions": 2048}


def test_a_node_s_account_refuses_connections_past_its_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server itself holds the cap, before the guard hears of it; the other node's
    connections are untouched."""
    monkeypatch.setenv("POOL_NODE_MAX_CONNECTIONS", "2")
    auth = _auth()

    async def go(server: NatsServer) -> list[str]:
        out, conns = [], []
        for node in ("n1", "n1", "n1", "n2", "n2"):
            try:
                conns.append(await _connect(server, auth, node))
                out.append("ok")
            except Exception as e:  # noqa: BLE001 - the refusal is the answer
                out.append(str(e))
        out += [str(ok) for ok in await _answers(conns[:2], "n1")]
        for c in conns:
            await c.close()
        return out

    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-node-acct",
                    extra_config=auth.render()) as server:
        out = asyncio.run(go(server))
    assert out[:2] == ["ok", "ok"] and out[3:] == ["ok", "ok", "True", "True"], out
    assert "maximum account active connections exceeded" in out[2], out


def test_a_node_s_account_refuses_subscriptions_past_its_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the account's subscriptions the server refuses the next (and closes that
    connection); the node's other account, n2, subscribes on."""
    monkeypatch.setenv("POOL_NODE_MAX_SUBSCRIPTIONS", "10")
    auth = _auth()
    async def go(server: NatsServer) -> dict[str, Any]:
        greedy = await _connect(server, auth, "n1")
        other = await _connect(server, auth, "n2")
        held = 0
        for i in range(12):
            if not greedy.is_connected:
                break
            await greedy.subscribe(f"pool.agent.n1.o{i}")
            try:
                await greedy.flush(2)
                held += 1
            except Exception:  # noqa: BLE001 - the server closed it
                break
        await _closed_within([greedy], 5)
        for i in range(8):  # below its own cap
            await other.subscribe(f"pool.agent.n2.o{i}")
        await other.flush(5)
        out = {"greedy_closed": greedy.is_closed, "other_open": other.is_connected,
               "held": held, "last_error": repr(greedy.last_error)}
        for c in (greedy, other):
            await c.close()
        return out

    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-node-subs",
                    extra_config=auth.render()) as server:
        monkeypatch.delenv("POOL_NODE_MAX_SUBSCRIPTIONS")
        out = asyncio.run(go(server))
    # the ten it may hold were held (a flush past them may come back before the server's
    # -ERR does, on a busy machine more than one); then that connection was closed with the
    # server's reason
    assert out["greedy_closed"] and out["other_open"] and out["held"] >= 10, out
    assert "maximum subscriptions exceeded" in out["last_error"], out


def test_the_guard_closes_a_node_s_connection_past_its_cap_and_no_other(
        plane: tuple[NatsServer, AuthConfig]) -> None:
    """Past the guard's node cap (below the account's, as on a cluster, where each server
    counts its own), the newest connection of that node is closed, and only it."""
    server, auth = plane
    caps = Caps(max_connections=3, max_subscriptions=100)

    async def go() -> dict[str, Any]:
        n1 = [await _connect(server, auth, "n1") for _ in range(3)]
        n2 = [await _connect(server, auth, "n2") for _ in range(3)]
        await asyncio.sleep(0.3)  # the guard has heard them
        try:
            one_more = await _connect(server, auth, "n1")
        except OSError:  # closed inside the client's handshake: closed too
            closed = True
        else:
            await _closed_within([one_more], 5)
            closed = one_more.is_closed
        await asyncio.sleep(0.3)  # nothing else is closed a moment later
        out = {"one_more_closed": closed, "n1": await _answers(n1, "n1"),
               "n2": await _answers(n2, "n2")}
        for c in n1 + n2:
            await c.close()
        return out

    guard = ConnectionGuard(guard_url(server.url, auth), user_caps(Caps(), caps),
                            sweep_seconds=3600).start()
    try:
        out = asyncio.run(go())
    finally:
        guard.stop()
    assert out == {"one_more_closed": True, "n1": [True] * 3, "n2": [True] * 3}, out
    assert guard.kicked == {"node-n1:max_connections": 1}


def test_the_guard_closes_the_greediest_connection_of_a_node_past_its_subscriptions(
        plane: tuple[NatsServer, AuthConfig]) -> None:
    server, auth = plane

    async def go() -> dict[str, Any]:
        light, greedy = await _connect(server, auth, "n1"), await _connect(server, auth, "n1")
        other = await _connect(server, auth, "n2")
        for i in range(3):
            await light.subscribe(f"pool.agent.n1.light{i}")
        for i in range(30):  # each connection far below the account's and the server's caps
            await greedy.subscribe(f"pool.agent.n1.l{i}")
        for i in range(15):
            await other.subscribe(f"pool.agent.n2.l{i}")
        for c in (light, greedy, other):
            await c.flush(5)
        await _closed_within([greedy], 5)
        out = {"greedy_closed": greedy.is_closed, "light": await _answers([light], "n1"),
               "other": await _answers([other], "n2")}
        for c in (light, other):
            await c.close()
        return out

    guard = ConnectionGuard(guard_url(server.url, auth),
                            user_caps(Caps(), Caps(max_connections=8, max_subscriptions=20)),
                            sweep_seconds=0.3).start()
    try:
        out = asyncio.run(go())
    finally:
        guard.stop()
    assert out == {"greedy_closed": True, "light": [True], "other": [True]}, out
    assert guard.kicked["node-n1:max_subscriptions"] == 1
    assert "node-n2:max_subscriptions" not in guard.kicked


def test_the_guard_caps_tenants_and_nodes_each_by_their_own_caps() -> None:
    tenant, node = Caps(64, 4096), Caps(8, 2048)
    caps_of = user_caps(tenant, node)
    assert caps_of("tenant-alpha") == tenant and caps_of("node-n1") == node
    assert caps_of("pool-service") is None and caps_of("pool-scheduler") is None
    assert user_caps(tenant)("node-n1") is None  # nodes uncapped when no caps are given


def test_a_node_cap_below_one_or_not_a_number_is_refused_naming_the_setting() -> None:
    assert Caps.nodes_from_env({}) == Caps(8, 2048)
    assert Caps.nodes_from_env({"POOL_NODE_MAX_CONNECTIONS": "3"}).max_connections == 3
    assert Caps.nodes_from_env({"POOL_TENANT_MAX_CONNECTIONS": "3"}) == Caps(8, 2048)
    for name in ("POOL_NODE_MAX_CONNECTIONS", "POOL_NODE_MAX_SUBSCRIPTIONS"):
        for bad in ("0", "-3", "lots", "1.5"):
            with pytest.raises(InvalidLimit) as raised:
                Caps.nodes_from_env({name: bad})
            assert raised.value.code == "invalid_limit" and name in str(raised.value)


def test_the_node_caps_are_kept_in_auth_json(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever renders the users later (the CLI adding one) renders the caps `pool up` was
    started with, not its own environment's; a file from before the node caps takes them."""
    path = tmp_path / "auth.json"
    auth = _auth()
    auth.node_caps = Caps(5, 50)
    bus_auth.save(auth, path)
    monkeypatch.setenv("POOL_NODE_MAX_CONNECTIONS", "7")
    loaded = bus_auth.load(path)
    assert loaded is not None and loaded.node_caps == Caps(5, 50)
    accounts = json.loads(loaded.render().removeprefix("accounts: "))
    assert accounts[node_account("n1")]["limits"] == {"max_connections": 5,
                                                      "max_subscriptions": 50}
    data = json.loads(path.read_text())
    del data["node_caps"]
    old = bus_auth.from_dict(data)
    assert old.node_caps == Caps(7, 2048) and old.tenant_caps == auth.tenant_caps
