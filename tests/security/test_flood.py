"""A malicious tenant's flood of crafted reply subjects, beside a tenant that works normally."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import nats

from bus.admin import ensure_all_streams
from bus.headers import HDR_TOPIC
from bus.local.auth import AuthConfig, inbox_prefix, url_with_credentials
from bus.local.server import NatsServer
from bus.subjects import AGENT_STREAM, EVENTS_STREAM, SCHEDULE_STREAM, SNAPSHOTS_STREAM
from client.api import PoolClient
from tests.control_plane import lease_body, setup_pool
from tests.security.conftest import service_url
from workers.plane import ControlPlane

ATTACKS = 1500
TARGETS = ["pool.evt.lease.{r}", "pool.evt.account.{r}", "pool.sched.lease.{r}",
           "pool.agent.gpu-7.start", "pool.agent.{r}.stop", "$KV.pool_leader.{r}",
           "$JS.API.STREAM.DELETE.POOL_EVENTS", "$JS.API.STREAM.PURGE.POOL_EVENTS",
           f"{inbox_prefix('beta')}.{{r}}", "_INBOX.n.gpu-7.{r}", "_INBOX.a.operator.{r}",
           "pool.cmd.beta.lease.request", "_INBOX.t.alpha", "_INBOX.t.alphax.{r}",
           "pool.snap.pool.{r}", "$JS.API.DIRECT.GET.POOL_SNAPSHOTS.pool.snap.pool.{r}"]


async def _flood(server: NatsServer, auth: AuthConfig) -> None:
    a = auth.tenants["alpha"]
    nc = await nats.connect(server.url, user=a.user, password=a.password,
                            inbox_prefix=inbox_prefix("alpha").encode())
    rnd = random.Random(7)
    verbs = ["lease.request", "lease.l1.get", "lease.l1.release", "telemetry.replay"]
    for i in range(ATTACKS):
        reply = rnd.choice(TARGETS).format(r=f"x{i}")
        body = json.dumps(lease_body(f"evil-{i}")).encode()
        await nc.publish(f"pool.cmd.alpha.{rnd.choice(verbs)}", body, reply=reply)
        if i % 200 == 0:
            await nc.flush()
    await nc.flush()
    await nc.close()


async def _foreign(url: str) -> dict[str, Any]:
    """Messages of the log without the recorder's headers, and anything on the work queue,
    timer and snapshot streams (no scheduler runs here, and no aggregate is due a snapshot, so
    nothing may be there)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    out: dict[str, Any] = {"foreign": []}
    for stream in (AGENT_STREAM, SCHEDULE_STREAM, SNAPSHOTS_STREAM):
        out[stream] = (await js.stream_info(stream)).state.messages
    state = (await js.stream_info(EVENTS_STREAM)).state
    out["events"] = state.messages
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await js.get_msg(EVENTS_STREAM, seq)
        if HDR_TOPIC not in (msg.headers or {}):
            out["foreign"].append((seq, msg.subject))
    await nc.close()
    return out


def test_a_flood_of_crafted_reply_subjects_lands_nothing_and_slows_no_one(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    url = service_url(server, auth)
    ensure_all_streams(url)
    cp = ControlPlane(url, roles=["commands"], data_plane=False,
                      responder_url=url_with_credentials(server.url, auth.responder)).start()
    try:
        with PoolClient(url) as admin:
            setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
        b = auth.tenants["beta"]
        with PoolClient(server.url, "beta", user=b.user, password=b.password) as beta:
            flood = asyncio.run_coroutine_threadsafe(_flood(server, auth), _loop())
            answers = [beta.request_lease(lease_body(f"good-{i}")) for i in range(40)]
            flood.result(120)
        assert all(r["ok"] for r in answers), [r for r in answers if not r["ok"]][:3]
        out = asyncio.run(_foreign(url))
    finally:
        cp.stop()
    assert out["foreign"] == []
    assert out[AGENT_STREAM] == 0 and out[SCHEDULE_STREAM] == 0 and out[SNAPSHOTS_STREAM] == 0
    # each crafted reply crossed into the plane's account as the server's own `_R_` reply
    # (ADR 027): the plane answered it, into alpha's own account, where nothing is stored
    assert cp.commands is not None and cp.commands.refused.count == 0


def _loop() -> asyncio.AbstractEventLoop:
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop
