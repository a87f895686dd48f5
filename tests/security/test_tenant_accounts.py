"""Each tenant lives in a NATS account of its own (ADR 027): whatever reply subject it names, no
answer lands in the plane's account, where every stream is; every path its permissions allow
still works, through the imports its account is given; its connections are capped there."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.admin import ensure_all_streams
from bus.local.accounts import adopt_global_store
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import artifacts_bucket, ensure_tenant_buckets_sync, work_bucket
from bus.replies import node_inbox, tenant_inbox
from tests.security.conftest import service_url
from workers.plane import ControlPlane

WORK, OUT = work_bucket("alpha"), artifacts_bucket("alpha")
# where an answer would do harm: the event log, a timer, the leader and positions buckets
TARGETS = (f"pool.evt.lease.{uuid.uuid4()}", f"pool.sched.lease.{uuid.uuid4()}",
           "$KV.pool_leaders.scheduler", "$KV.pool_positions.dispatcher")
# everything alpha may publish and be answered on, as (subject, body)
ANSWERED = {
    "a chunk's store": (f"$O.{WORK}.C.aimed", b"x"),
    "a metadata store": (f"$O.{WORK}.M.aimed", b"{}"),
    "its work bucket's info": (f"$JS.API.STREAM.INFO.OBJ_{WORK}", b""),
    "its artifacts bucket's info": (f"$JS.API.STREAM.INFO.OBJ_{OUT}", b""),
    "a purge of its work bucket": (f"$JS.API.STREAM.PURGE.OBJ_{WORK}",
                                   json.dumps({"filter": f"$O.{WORK}.C.none"}).encode()),
    "a direct get by sequence": (f"$JS.API.DIRECT.GET.OBJ_{WORK}", b'{"seq": 1}'),
    "a direct get by subject": (f"$JS.API.DIRECT.GET.OBJ_{WORK}.$O.{WORK}.C.seed", b""),
    "a batched direct get": (f"$JS.API.DIRECT.GET.OBJ_{WORK}", json.dumps(
        {"seq": 1, "next_by_subj": f"$O.{WORK}.C.>", "batch": 5}).encode()),
    "a direct get of its artifacts": (f"$JS.API.DIRECT.GET.OBJ_{OUT}", b'{"seq": 1}'),
    "a session's input": ("pool.sess.alpha.gpu-7.s1.in", b"i"),
}


@pytest.fixture()
def plane(secured: tuple[NatsServer, AuthConfig]) -> tuple[NatsServer, AuthConfig, str]:
    server, auth = secured
    url = service_url(server, auth)
    ensure_all_streams(url, tenants=["alpha", "beta"])
    ensure_tenant_buckets_sync(url, ["alpha", "beta"])
    return server, auth, url


async def _stored(svc: Any) -> dict[str, int]:
    """Messages held by every stream of the plane's account but alpha's own work bucket
    (where its stores land by right)."""
    js = svc.jetstream()
    return {s.config.name: int(s.state.messages or 0) for s in await js.streams_info()
            if s.config.name != f"OBJ_{WORK}"}


async def _tenant(server: NatsServer, auth: AuthConfig, tenant: str = "alpha") -> Any:
    return await nats.connect(url_with_credentials(server.url, auth.tenants[tenant]),
                              inbox_prefix=tenant_inbox(tenant).encode())


async def _aim(server: NatsServer, auth: AuthConfig, url: str, things: list[tuple[str, bytes]],
               *, as_operator: bool = False) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Publish each of `things` with each target as its reply, as alpha (or, the control, as
    the operator); the streams' counts before and after, and what the plane's account heard
    on the targets."""
    svc = await nats.connect(url)
    heard: list[str] = []

    async def on_msg(msg: Any) -> None:
        heard.append(msg.subject)

    for target in TARGETS:
        await svc.subscribe(target, cb=on_msg)
    await svc.flush()
    alpha = await _tenant(server, auth)
    await alpha.jetstream().publish(f"$O.{WORK}.C.seed", b"seed")  # something to get
    before = await _stored(svc)
    sender = svc if as_operator else alpha
    for subject, body in things:
        for target in TARGETS:
            await sender.publish(subject, body, reply=target)
    await sender.flush()
    await asyncio.sleep(1.0)  # what the server had queued is stored by then
    after = await _stored(svc)
    for c in (alpha, svc):
        await c.close()
    return before, after, heard


@pytest.mark.parametrize("thing", sorted(ANSWERED))
def test_no_answer_a_tenant_aims_at_the_plane_is_stored(
        plane: tuple[NatsServer, AuthConfig, str], thing: str) -> None:
    before, after, heard = asyncio.run(_aim(*plane, [ANSWERED[thing]]))
    assert heard == []
    assert after == before


def test_the_same_answers_aimed_from_the_plane_s_account_are_stored(
        plane: tuple[NatsServer, AuthConfig, str]) -> None:
    """The control: the count above sees junk where junk is made (the operator shares the
    plane's account, and the server answers wherever its client says)."""
    before, after, heard = asyncio.run(_aim(*plane, [ANSWERED["its work bucket's info"]],
                                            as_operator=True))
    grew = {s for s in after if after[s] > before.get(s, 0)}
    assert grew == {"POOL_EVENTS", "POOL_SCHED", "KV_pool_leaders", "KV_pool_positions"}
    assert len(heard) == len(TARGETS)


def test_a_tenant_s_command_aimed_at_the_plane_is_answered_into_its_own_account(
        plane: tuple[NatsServer, AuthConfig, str]) -> None:
    server, auth, url = plane
    cp = ControlPlane(url, roles=["commands"], data_plane=False).start()
    try:
        before, after, heard = asyncio.run(_aim(server, auth, url, [
            ("pool.cmd.alpha.lease.l1.get", b"{}")]))
        assert heard == [] and after == before
        # every one answered (on the server's `_R_` reply), none refused
        assert cp.commands is not None and cp.commands.refused.count == 0
    finally:
        cp.stop()


def test_every_path_a_tenant_has_still_works_from_its_own_account(
        plane: tuple[NatsServer, AuthConfig, str], tmp_path: Path) -> None:
    from bus.service import Client

    server, auth, url = plane

    async def go() -> dict[str, Any]:
        svc = await nats.connect(url)
        n = auth.nodes["gpu-7"]
        node = await nats.connect(url_with_credentials(server.url, n),
                                  inbox_prefix=node_inbox("gpu-7").encode())
        alpha, beta = await _tenant(server, auth), await _tenant(server, auth, "beta")
        got: dict[str, list[bytes]] = {"alpha": [], "beta": [], "node": []}

        def keep(who: str) -> Any:
            async def cb(msg: Any) -> None:
                got[who].append(bytes(msg.data))
            return cb

        for who, c in (("alpha", alpha), ("beta", beta)):
            t = who
            await c.subscribe(f"pool.tel.*.*.{t}.>", cb=keep(who))
            await c.subscribe(f"pool.feedlive.{t}.>", cb=keep(who))
            await c.subscribe(f"pool.sess.{t}.*.*.out", cb=keep(who))
            await c.flush()
        await node.subscribe("pool.sess.*.gpu-7.*.in", cb=keep("node"))
        await node.flush()
        await node.publish("pool.tel.output.gpu-7.alpha.l1", b"tel")
        await svc.publish("pool.feedlive.alpha.lease.l1", b"feed")
        await node.publish("pool.sess.alpha.gpu-7.s1.out", b"out")
        await alpha.publish("pool.sess.alpha.gpu-7.s1.in", b"in")
        for c in (node, svc, alpha):
            await c.flush()
        await asyncio.sleep(0.5)
        info = await alpha.request(f"$JS.API.STREAM.INFO.OBJ_{OUT}", b"", timeout=5)
        for c in (svc, node, alpha, beta):
            await c.close()
        return {**got, "info": json.loads(info.data)}


    out = asyncio.run(go())
    assert sorted(out["alpha"]) == [b"feed", b"out", b"tel"]
    assert out["beta"] == [] and out["node"] == [b"in"]
    assert out["info"].get("config", {}).get("name") == f"OBJ_{OUT}", out["info"]
    # its files through the project's own client: a put, then a batched get of it
    source = tmp_path / "work.tar"
    source.write_bytes(bytes(range(256)) * 4096)
    client = Client(url_with_credentials(server.url, auth.tenants["alpha"]),
                    inbox_prefix=tenant_inbox("alpha").encode())
    try:
        client.files().put(WORK, "w1", source)
        client.files().get(WORK, "w1", tmp_path / "back.tar")
    finally:
        client.close()
    assert (tmp_path / "back.tar").read_bytes() == source.read_bytes()


def test_a_tenant_s_account_refuses_connections_past_its_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server itself holds the cap (the account's limits), before the guard hears of it."""
    monkeypatch.setenv("POOL_TENANT_MAX_CONNECTIONS", "2")
    auth = AuthConfig()
    auth.add_tenant("alpha")
    auth.add_tenant("beta")

    async def go(server: NatsServer) -> list[str]:
        out, conns = [], []
        for tenant in ("alpha", "alpha", "alpha", "beta", "beta"):
            try:
                conns.append(await nats.connect(
                    url_with_credentials(server.url, auth.tenants[tenant]),
                    allow_reconnect=False, max_reconnect_attempts=0))
                out.append("ok")
            except Exception as e:  # noqa: BLE001 - the refusal is the answer
                out.append(str(e))
        for c in conns:
            await c.close()
        return out

    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-acct-caps",
                    extra_config=auth.render()) as server:
        out = asyncio.run(go(server))
    assert out[:2] == ["ok", "ok"] and out[3:] == ["ok", "ok"]
    assert "maximum account active connections exceeded" in out[2]


def test_a_store_from_before_accounts_keeps_its_streams(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    with NatsServer(store_dir=store, server_name="pool-old") as old:
        ensure_all_streams(old.url)  # every user in the global account then
    assert adopt_global_store(store / "jetstream")
    assert not adopt_global_store(store / "jetstream")  # once
    auth = AuthConfig()
    with NatsServer(store_dir=store, server_name="pool-old", extra_config=auth.render()) as new:
        async def names() -> list[str]:
            nc = await nats.connect(service_url(new, auth))
            out = [s.config.name for s in await nc.jetstream().streams_info()]
            await nc.close()
            return out

        assert "POOL_EVENTS" in asyncio.run(names())


def test_a_tenant_added_to_a_running_server_is_answered_after_its_reloads(
        tmp_path: Path) -> None:
    """nats-server wires a new account's service imports at its second reload only: the
    include says so, and `reload` makes both."""
    from bus.local.auth import write_server_include

    auth = AuthConfig()
    auth.add_tenant("alpha")
    include = tmp_path / "nats" / "auth.conf"
    include.parent.mkdir(parents=True)
    assert write_server_include(auth, include)
    with NatsServer(store_dir=tmp_path / "nats", server_name="pool-grow",
                    extra_config='include "auth.conf"') as server:
        assert write_server_include(auth, include) == 0  # the same: no reload
        auth.add_tenant("beta")
        reloads = write_server_include(auth, include)
        assert reloads == 2
        server.reload(reloads)

        async def answered(tenant: str) -> bytes:
            svc = await nats.connect(service_url(server, auth))

            async def answer(msg: Any) -> None:
                await svc.publish(msg.reply, b"answer")

            await svc.subscribe("pool.cmd.>", cb=answer)
            await svc.flush()
            nc = await _tenant(server, auth, tenant)
            try:
                return bytes((await nc.request(f"pool.cmd.{tenant}.x", b"", timeout=2)).data)
            finally:
                for c in (nc, svc):
                    await c.close()

        assert asyncio.run(answered("beta")) == b"answer"
        assert asyncio.run(answered("alpha")) == b"answer"
        auth.add_tenant("beta", password="rotated-password-of-beta")
        assert write_server_include(auth, include) == 1  # a password only: one reload
