"""Each node lives in a NATS account of its own (ADR 028): whatever reply subject a node agent
names, no answer of the server's lands in the plane's account, where every stream is; every
path its permissions allow still works, through the imports its account is given."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.admin import ensure_all_streams
from bus.agentbus import ControlLink
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import artifacts_bucket, ensure_tenant_buckets_sync, work_bucket
from bus.replies import node_inbox, tenant_inbox
from tests.security.conftest import service_url
from workers.plane import ControlPlane

NODE = "gpu-7"
WORK, OUT = work_bucket("alpha"), artifacts_bucket("alpha")
QUEUE = f"agent-{NODE}"
# where an answer would do harm: the event log, a timer, the leader and positions buckets
TARGETS = (f"pool.evt.lease.{uuid.uuid4()}", f"pool.sched.lease.{uuid.uuid4()}",
           "$KV.pool_leaders.scheduler", "$KV.pool_positions.dispatcher")
# everything the node may publish and be answered on, as (subject, body)
ANSWERED = {
    "an artifact's chunk": (f"$O.{OUT}.C.aimed", b"x"),
    "an artifact's metadata": (f"$O.{OUT}.M.aimed", b"{}"),
    "the artifacts bucket's info": (f"$JS.API.STREAM.INFO.OBJ_{OUT}", b""),
    "a direct get of a work directory": (f"$JS.API.DIRECT.GET.OBJ_{WORK}", b'{"seq": 1}'),
    "a direct get by subject": (f"$JS.API.DIRECT.GET.OBJ_{WORK}.$O.{WORK}.C.seed", b""),
    "a batched direct get": (f"$JS.API.DIRECT.GET.OBJ_{WORK}", json.dumps(
        {"seq": 1, "next_by_subj": f"$O.{WORK}.C.>", "batch": 5}).encode()),
    "a telemetry sample": (f"pool.tel.p1.{NODE}.alpha.l1.output", b"line"),
    "a pull of its work queue": (f"$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.{QUEUE}",
                                 json.dumps({"batch": 1, "no_wait": True}).encode()),
    "a session's output": (f"pool.sess.alpha.{NODE}.s1.out", b"o"),
    "a report": (f"pool.node.{NODE}.heartbeat", b"{}"),
}
# the streams the node writes by right (its artifacts, its telemetry), or the test seeds
WRITTEN = {f"OBJ_{WORK}", f"OBJ_{OUT}", "POOL_TELEMETRY", "POOL_TEL_alpha"}


@pytest.fixture()
def plane(secured: tuple[NatsServer, AuthConfig]) -> tuple[NatsServer, AuthConfig, str]:
    server, auth = secured
    url = service_url(server, auth)
    ensure_all_streams(url, tenants=["alpha", "beta"])
    ensure_tenant_buckets_sync(url, ["alpha", "beta"])
    control = ControlLink(url)
    try:
        control.ensure_agent_consumer(NODE)
        for i in range(len(TARGETS)):  # an order for each pull aimed at a target
            control.send(NODE, "start", b"{}", msg_id=f"order-{i}")
    finally:
        control.close()
    return server, auth, url


async def _stored(svc: Any) -> dict[str, int]:
    """Messages held by every stream of the plane's account but those the node writes."""
    js = svc.jetstream()
    return {s.config.name: int(s.state.messages or 0) for s in await js.streams_info()
            if s.config.name not in WRITTEN}


async def _node(server: NatsServer, auth: AuthConfig) -> Any:
    return await nats.connect(url_with_credentials(server.url, auth.nodes[NODE]),
                              inbox_prefix=node_inbox(NODE).encode())


async def _aim(server: NatsServer, auth: AuthConfig, url: str, things: list[tuple[str, bytes]],
               *, as_operator: bool = False) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Publish each of `things` with each target as its reply, as the node (or, the control,
    as the operator); the streams' counts before and after, and what the plane's account
    heard on the targets."""
    svc = await nats.connect(url)
    heard: list[str] = []

    async def on_msg(msg: Any) -> None:
        heard.append(msg.subject)

    for target in TARGETS:
        await svc.subscribe(target, cb=on_msg)
    await svc.flush()
    await svc.jetstream().publish(f"$O.{WORK}.C.seed", b"seed")  # something to get
    before = await _stored(svc)
    sender = svc if as_operator else await _node(server, auth)
    for subject, body in things:
        for target in TARGETS:
            await sender.publish(subject, body, reply=target)
    await sender.flush()
    await asyncio.sleep(1.0)  # what the server had queued is stored by then
    after = await _stored(svc)
    for c in {id(sender): sender, id(svc): svc}.values():
        await c.close()
    return before, after, heard


@pytest.mark.parametrize("thing", sorted(ANSWERED))
def test_no_answer_a_node_aims_at_the_plane_is_stored(
        plane: tuple[NatsServer, AuthConfig, str], thing: str) -> None:
    before, after, heard = asyncio.run(_aim(*plane, [ANSWERED[thing]]))
    assert heard == []
    assert after == before


@pytest.mark.parametrize("thing", ["a pull of its work queue",
                                   "a direct get of a work directory"])
def test_the_same_answers_aimed_from_the_plane_s_account_are_stored(
        plane: tuple[NatsServer, AuthConfig, str], thing: str) -> None:
    """The control: the count above sees junk where junk is made (the operator shares the
    plane's account, and the server answers wherever its client says)."""
    before, after, heard = asyncio.run(_aim(*plane, [ANSWERED[thing]], as_operator=True))
    grew = {s for s in after if after[s] > before.get(s, 0)}
    assert grew == {"POOL_EVENTS", "POOL_SCHED", "KV_pool_leaders", "KV_pool_positions"}
    assert len(heard) == len(TARGETS)


def test_a_node_s_report_aimed_at_the_plane_is_answered_into_its_own_account(
        plane: tuple[NatsServer, AuthConfig, str]) -> None:
    server, auth, url = plane
    cp = ControlPlane(url, roles=["commands"], data_plane=False).start()
    try:
        before, after, heard = asyncio.run(_aim(server, auth, url, [ANSWERED["a report"]]))
        assert heard == [] and after == before
        # every one answered (on the server's `_R_` reply), none refused

        async def ask() -> bytes:
            nc = await _node(server, auth)
            try:
                return bytes((await nc.request(f"pool.node.{NODE}.heartbeat", b"{}",
                                               timeout=5)).data)
            finally:
                await nc.close()

        assert asyncio.run(ask())  # the node hears its answer
        assert cp.commands is not None and cp.commands.refused.count == 0
    finally:
        cp.stop()


def test_a_session_crosses_from_a_tenant_s_account_to_a_node_s_and_back(
        plane: tuple[NatsServer, AuthConfig, str]) -> None:
    """Service imports chain through POOL (stream imports do not): a tenant's `in` reaches
    the node's account, the node's `out` and telemetry the tenant's, in order; no other
    tenant hears them."""
    server, auth, _ = plane
    count = 2000

    async def go() -> dict[str, list[bytes]]:
        node = await _node(server, auth)
        alpha, beta = [await nats.connect(url_with_credentials(server.url, auth.tenants[t]),
                                          inbox_prefix=tenant_inbox(t).encode())
                       for t in ("alpha", "beta")]
        got: dict[str, list[bytes]] = {"alpha": [], "beta": [], "node": [], "tel": []}

        def keep(who: str) -> Any:
            async def cb(msg: Any) -> None:
                got[who].append(bytes(msg.data))
            return cb

        await node.subscribe(f"pool.sess.*.{NODE}.*.in", cb=keep("node"))
        await alpha.subscribe("pool.sess.alpha.*.*.out", cb=keep("alpha"))
        await alpha.subscribe("pool.tel.*.*.alpha.>", cb=keep("tel"))
        for t in ("pool.sess.beta.*.*.out", "pool.tel.*.*.beta.>"):
            await beta.subscribe(t, cb=keep("beta"))
        for c in (node, alpha, beta):
            await c.flush()
        for i in range(count):
            await alpha.publish(f"pool.sess.alpha.{NODE}.s1.in", b"%d" % i)
            await node.publish(f"pool.sess.alpha.{NODE}.s1.out", b"%d" % i)
        ack = await node.jetstream().publish(f"pool.tel.p1.{NODE}.alpha.l1.output", b"tel")
        for c in (node, alpha):
            await c.flush()
        for _ in range(100):
            if len(got["node"]) == len(got["alpha"]) == count and got["tel"]:
                break
            await asyncio.sleep(0.05)
        for c in (node, alpha, beta):
            await c.close()
        assert ack.stream == "POOL_TEL_alpha"
        return got

    got = asyncio.run(go())
    sent = [b"%d" % i for i in range(count)]
    assert got["node"] == sent and got["alpha"] == sent
    assert got["tel"] == [b"tel"] and got["beta"] == []


def test_a_node_s_account_imports_only_its_own_subjects(tmp_path: Path) -> None:
    from bus.local.accounts import node_account

    auth = AuthConfig()
    auth.add_tenant("alpha")
    auth.add_node("n1")
    auth.add_node("n2")
    accounts = json.loads(auth.render().removeprefix("accounts: "))
    n1 = json.dumps(accounts[node_account("n1")])
    assert "n2" not in n1 and "jetstream" not in accounts[node_account("n1")]
    pool_users = {u["user"] for u in accounts["POOL"]["users"]}
    assert not any(u.startswith("node-") for u in pool_users)
