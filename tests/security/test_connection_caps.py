"""A tenant's NATS user holds at most its caps of connections and subscriptions, all its
connections together, enforced through the server (the connection guard, ADR 023)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.caps import Caps, InvalidLimit
from bus.connguard import ConnectionGuard, tenant_caps
from bus.local.auth import AuthConfig, guard_url, url_with_credentials
from bus.local.server import NatsServer


@pytest.fixture()
def plane(tmp_path: Path) -> Iterator[tuple[NatsServer, AuthConfig]]:
    auth = AuthConfig()
    for tenant in ("alpha", "beta"):
        auth.add_tenant(tenant)
    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-caps",
                    extra_config=auth.render()) as server:
        yield server, auth


async def _connect(server: NatsServer, auth: AuthConfig, tenant: str) -> Any:
    async def quiet(_e: Exception) -> None:
        pass

    c = auth.tenants[tenant]
    return await nats.connect(server.url, user=c.user, password=c.password, error_cb=quiet,
                              allow_reconnect=False, max_reconnect_attempts=0)


async def _closed_within(conns: list[Any], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(c.is_closed for c in conns):
        await asyncio.sleep(0.05)


async def _each_hears(server: NatsServer, auth: AuthConfig, tenant: str,
                      conns: list[Any]) -> list[bool]:
    """Whether each of `conns` still subscribes and hears its tenant's telemetry."""
    subs = [await c.subscribe(f"pool.tel.p1.n1.{tenant}.>") for c in conns]
    for c in conns:
        await c.flush(5)
    publisher = await nats.connect(url_with_credentials(server.url, auth.service))
    await publisher.publish(f"pool.tel.p1.n1.{tenant}.l1.output", b"x")
    await publisher.flush(5)
    heard = []
    for s in subs:
        try:
            heard.append((await s.next_msg(timeout=5)).data == b"x")
        except Exception:  # noqa: BLE001 - not hearing is the answer
            heard.append(False)
    await publisher.close()
    return heard


async def _one_past_the_cap(server: NatsServer, auth: AuthConfig, cap: int) -> dict[str, Any]:
    alpha = [await _connect(server, auth, "alpha") for _ in range(cap)]
    beta = [await _connect(server, auth, "beta") for _ in range(cap)]
    await asyncio.sleep(0.3)  # the guard has heard them
    try:
        one_more = await _connect(server, auth, "alpha")
    except OSError as e:  # the guard closed it inside the client's handshake: closed too
        closed, error = True, repr(e)
    else:
        await _closed_within([one_more], 5)
        closed, error = one_more.is_closed, repr(one_more.last_error)
    await asyncio.sleep(0.3)  # nothing else is closed a moment later
    out = {"one_more_closed": closed, "error": error,
           "alpha_open": [c.is_connected for c in alpha],
           "beta_open": [c.is_connected for c in beta],
           "alpha_hears": await _each_hears(server, auth, "alpha", alpha),
           "beta_hears": await _each_hears(server, auth, "beta", beta)}
    for c in alpha + beta:
        await c.close()
    return out


def test_a_tenant_opening_one_connection_past_its_cap_has_it_closed_and_no_other(
        plane: tuple[NatsServer, AuthConfig], caplog: pytest.LogCaptureFixture) -> None:
    server, auth = plane
    caps = Caps(max_connections=4, max_subscriptions=100)
    # no sweep during the test: the connect advisory alone closes the connection
    guard = ConnectionGuard(guard_url(server.url, auth), tenant_caps(caps),
                            sweep_seconds=3600).start()
    try:
        with caplog.at_level(logging.WARNING, logger="bus.connguard"):
            out = asyncio.run(_one_past_the_cap(server, auth, caps.max_connections))
    finally:
        guard.stop()
    assert out["one_more_closed"], out
    assert out["alpha_open"] == [True] * 4 and out["alpha_hears"] == [True] * 4, out
    assert out["beta_open"] == [True] * 4 and out["beta_hears"] == [True] * 4, out
    assert guard.kicked == {"tenant-alpha:max_connections": 1}
    # the documented reason, in the plane's log: the user, the count and the setting
    assert any("tenant-alpha" in r.message and "over its cap of 4" in r.message
               and "max_connections" in r.message for r in caplog.records), caplog.text


async def _subscribing_past_the_cap(server: NatsServer, auth: AuthConfig) -> dict[str, Any]:
    light, greedy = await _connect(server, auth, "alpha"), await _connect(server, auth, "alpha")
    other = await _connect(server, auth, "beta")
    for i in range(5):
        await light.subscribe(f"pool.tel.p1.n1.alpha.light{i}.output")
    for i in range(30):  # each connection far below the server's per-connection cap
        await greedy.subscribe(f"pool.tel.p1.n1.alpha.l{i}.output")
    for i in range(15):
        await other.subscribe(f"pool.tel.p1.n1.beta.l{i}.output")
    for c in (light, greedy, other):
        await c.flush(5)
    await _closed_within([greedy], 5)
    out = {"greedy_closed": greedy.is_closed, "light_open": light.is_connected,
           "other_open": other.is_connected,
           "light_hears": await _each_hears(server, auth, "alpha", [light]),
           "other_hears": await _each_hears(server, auth, "beta", [other])}
    for c in (light, other):
        await c.close()
    return out


def test_a_tenant_holding_subscriptions_past_its_cap_loses_its_greediest_connection(
        plane: tuple[NatsServer, AuthConfig]) -> None:
    server, auth = plane
    guard = ConnectionGuard(guard_url(server.url, auth),
                            tenant_caps(Caps(max_connections=8, max_subscriptions=20)),
                            sweep_seconds=0.3).start()
    try:
        out = asyncio.run(_subscribing_past_the_cap(server, auth))
    finally:
        guard.stop()
    assert out["greedy_closed"] and out["light_open"] and out["other_open"], out
    assert out["light_hears"] == [True] and out["other_hears"] == [True], out
    assert guard.kicked["tenant-alpha:max_subscriptions"] == 1
    assert "tenant-beta:max_subscriptions" not in guard.kicked


async def _open(server: NatsServer, auth: AuthConfig, n: int) -> list[Any]:
    conns = []
    for _ in range(n):
        conns.append(await _connect(server, auth, "alpha"))
        await asyncio.sleep(0.01)  # each its own start time
    return conns


def test_a_guard_started_late_closes_the_newest_connections_past_the_cap(
        plane: tuple[NatsServer, AuthConfig]) -> None:
    server, auth = plane

    async def go() -> dict[str, Any]:
        conns = await _open(server, auth, 5)
        # a server's list that came too late for the start's count is in the next one's
        guard = await asyncio.to_thread(ConnectionGuard(
            guard_url(server.url, auth), tenant_caps(Caps(max_connections=3)),
            sweep_seconds=1).start)
        await _closed_within(conns[3:], 5)
        await asyncio.to_thread(guard.stop)
        out = {"closed": [c.is_closed for c in conns]}
        for c in conns:
            await c.close()
        return out

    assert asyncio.run(go())["closed"] == [False, False, False, True, True]


def test_a_tenant_cap_below_one_or_not_a_number_is_refused() -> None:
    assert Caps.from_env({}) == Caps(64, 4096)
    assert Caps.from_env({"POOL_TENANT_MAX_CONNECTIONS": "8"}).max_connections == 8
    for bad in ("0", "-3", "lots", "1.5"):
        with pytest.raises(InvalidLimit) as raised:
            Caps.from_env({"POOL_TENANT_MAX_SUBSCRIPTIONS": bad})
        assert raised.value.code == "invalid_limit" and "POOL_TENANT_MAX_SUBSCRIPTIONS" in str(
            raised.value)



def test_a_burst_of_connections_leaves_the_tenant_exactly_its_cap(
        plane: tuple[NatsServer, AuthConfig]) -> None:
    server, auth = plane

    async def go() -> int:
        conns = await asyncio.gather(*(_connect(server, auth, "alpha") for _ in range(24)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(not c.is_closed for c in conns) > 4:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # and no more than the extra ones go
        open_ = sum(not c.is_closed for c in conns)
        for c in conns:
            await c.close()
        return open_

    guard = ConnectionGuard(guard_url(server.url, auth), tenant_caps(Caps(max_connections=4)),
                            sweep_seconds=3600).start()
    try:
        assert asyncio.run(go()) == 4
    finally:
        guard.stop()



def test_a_tenant_spreading_its_connections_over_a_cluster_is_counted_on_all_servers(
        tmp_path: Path) -> None:
    """Counted from every server's list at the guard's start, and from every server's
    advisories after it."""
    from bus.local.cluster import NatsCluster

    auth = AuthConfig()
    auth.add_tenant("alpha")
    c = auth.tenants["alpha"]

    async def go(urls: list[str], url: str) -> dict[str, list[bool]]:
        async def connect(i: int) -> Any:
            nc = await nats.connect(urls[i % 3], user=c.user, password=c.password,
                                    allow_reconnect=False, max_reconnect_attempts=0)
            await asyncio.sleep(0.05)  # each its own start time
            return nc

        # servers 1, 2, 3, 1: no server holds more than two, together they hold four
        conns = [await connect(i) for i in range(4)]
        # a server's list that came too late for the start's count is in the next one's
        guard = await asyncio.to_thread(ConnectionGuard(
            url, tenant_caps(Caps(max_connections=3)), sweep_seconds=1).start)
        await _closed_within(conns[3:], 5)
        at_start = [x.is_closed for x in conns]
        try:
            conns.append(await connect(4))  # on server 2
            await _closed_within(conns[4:], 5)
            kicked_in_handshake = False
        except OSError:  # the guard closed it inside the client's handshake: closed too
            kicked_in_handshake = True
        await asyncio.sleep(0.3)
        after = [x.is_closed for x in conns] + [True] * kicked_in_handshake
        await asyncio.to_thread(guard.stop)
        for x in conns:
            await x.close()
        return {"at_start": at_start, "after": after}

    with NatsCluster(tmp_path / "cluster", nodes=3, auth=auth, cluster_name="caps") as cluster:
        out = asyncio.run(go(cluster.urls, guard_url(cluster.url, auth)))
    assert out == {"at_start": [False, False, False, True],
                   "after": [False, False, False, True, True]}


def test_pool_guard_holds_tenants_of_servers_it_did_not_start(
        plane: tuple[NatsServer, AuthConfig]) -> None:
    """compose.yaml's way: the guard's own process, its user and password from the
    environment, as `pool cluster auth`'s .env gives them."""
    import os
    import subprocess
    import sys

    server, auth = plane
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")} | {
        "POOL_NATS_URL": server.url, "POOL_NATS_USER": auth.guard.user,
        "POOL_NATS_PASSWORD": auth.guard.password, "POOL_TENANT_MAX_CONNECTIONS": "2",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "guard"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert "guarding" in proc.stdout.readline()

        async def go() -> list[bool]:
            conns = [await _connect(server, auth, "alpha") for _ in range(3)]
            await _closed_within(conns[2:], 5)
            out = [c.is_closed for c in conns]
            for c in conns:
                await c.close()
            return out

        assert asyncio.run(go()) == [False, False, True]
    finally:
        proc.send_signal(2)
        assert proc.wait(20) == 0


def test_a_server_started_before_the_guard_s_user_takes_it_at_a_reload(tmp_path: Path) -> None:
    """An upgraded `pool up` (or `pool admin tenant creds`) re-renders the users of a server
    that is already running and reloads it: the guard's user must load without a restart."""
    from bus.local.auth import write_server_include

    auth = AuthConfig()
    auth.add_tenant("alpha")
    include = tmp_path / "nats" / "auth.conf"
    include.parent.mkdir(parents=True)
    # the users as they were rendered before the system account had one (and before tenants
    # had accounts of their own: every user in the global account)
    users = [{"user": c.user, "password": c.password_hash()}
             for c in (auth.service, *auth.tenants.values())]
    include.write_text(f"authorization {{ users: {json.dumps(users)} }}\n")
    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-old",
                    extra_config='include "auth.conf"') as server:
        server.reload(write_server_include(auth, include))
        assert "Failed to reload" not in server.log_path.read_text()
        guard = ConnectionGuard(guard_url(server.url, auth), tenant_caps(Caps(max_connections=1)),
                                sweep_seconds=3600).start()
        try:
            async def go() -> list[bool]:
                conns = [await _connect(server, auth, "alpha") for _ in range(2)]
                await _closed_within(conns[1:], 5)
                out = [c.is_closed for c in conns]
                for c in conns:
                    await c.close()
                return out

            assert asyncio.run(go()) == [False, True]
        finally:
            guard.stop()


def test_a_guard_the_servers_do_not_know_is_refused_at_its_start(
        plane: tuple[NatsServer, AuthConfig]) -> None:
    from bus.errors import BusUnavailable
    from bus.local.auth import Credentials

    server, _ = plane
    impostor = url_with_credentials(server.url, Credentials("pool-guard", "not-its-password"))
    with pytest.raises(BusUnavailable) as raised:
        ConnectionGuard(impostor, tenant_caps(Caps())).start()
    assert raised.value.code == "bus_unavailable"
