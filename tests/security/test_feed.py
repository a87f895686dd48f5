"""A tenant reads only its own lease feed: the server refuses another tenant's feed subjects and
the stream's API, and the replay service reads only the requester's own records."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import nats

from bus.admin import ensure_all_streams
from bus.feed import FeedWriter
from bus.local.auth import AuthConfig, inbox_prefix, url_with_credentials
from bus.local.server import NatsServer
from bus.runtime import BusRuntime
from bus.subjects import feed_subject
from schemas.feed import FeedRecord
from tests.security.conftest import service_url
from workers.plane import ControlPlane


def _record(tenant: str, lease: str) -> bytes:
    return msgspec.json.encode(FeedRecord(
        lease_id=lease, tenant=tenant, pool_id="p1", state="queued",
        previous_state="requested", event="LeaseQueued", version=2, log_sequence=7,
        at=1_800_000_000.0))


async def _beta_tries(server: NatsServer, auth: AuthConfig) -> dict[str, Any]:
    errors: list[str] = []
    got: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    async def on_msg(msg: Any) -> None:
        got.append(msg.subject)

    b = auth.tenants["beta"]
    beta = await nats.connect(server.url, user=b.user, password=b.password,
                              inbox_prefix=inbox_prefix("beta").encode(), error_cb=on_error)
    refused: dict[str, bool] = {}
    for subject in ("pool.feedlive.alpha.>", "pool.feedlive.>", "pool.feed.alpha.>",
                    "pool.feed.>"):
        before = len(errors)
        await beta.subscribe(subject, cb=on_msg)
        await beta.flush()
        await asyncio.sleep(0.1)
        refused[f"subscribe {subject}"] = len(errors) > before
    for subject in ("$JS.API.DIRECT.GET.POOL_FEED", "$JS.API.STREAM.MSG.GET.POOL_FEED",
                    "$JS.API.CONSUMER.CREATE.POOL_FEED.x.pool.feed.alpha.>",
                    "pool.cmd.alpha.feed.replay"):
        before = len(errors)
        try:
            await beta.request(subject, b'{"seq": 1}', timeout=1)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            pass
        await asyncio.sleep(0.1)
        refused[f"publish {subject}"] = len(errors) > before
    # its own replay: the service reads under beta's token only
    reply = await beta.request("pool.cmd.beta.feed.replay", b"{}", timeout=5)
    own = msgspec.json.decode(reply.data)
    # alpha's next record, stored while beta listens wherever the server let it
    await asyncio.to_thread(write_out, server, auth, [("alpha", "l2")])
    await asyncio.sleep(0.3)
    await beta.close()
    return {"refused": refused, "got": got, "own": own}


def write_out(server: NatsServer, auth: AuthConfig, leases: list[tuple[str, str]]) -> None:
    url = service_url(server, auth)
    rt = BusRuntime(url)
    try:
        writer = FeedWriter(url, runtime=rt)
        writer.ensure()
        last = writer.position().feed_seq
        writer.append([(feed_subject(t, lid), _record(t, lid), 7) for t, lid in leases],
                      expect_last=last)
    finally:
        rt.close()


def test_a_tenant_cannot_read_another_tenants_feed(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    ensure_all_streams(service_url(server, auth))
    write_out(server, auth, [("alpha", "l1"), ("beta", "b1")])
    cp = ControlPlane(service_url(server, auth), roles=["commands"], data_plane=False,
                      responder_url=url_with_credentials(server.url, auth.responder)).start()
    try:
        out = asyncio.run(_beta_tries(server, auth))
    finally:
        cp.stop()
    assert all(out["refused"].values()), out["refused"]
    assert out["got"] == []
    records = out["own"]["result"]["records"]
    assert [(r["record"]["tenant"], r["record"]["lease_id"]) for r in records] == \
        [("beta", "b1")]


async def _alpha_follows(server: NatsServer, auth: AuthConfig) -> list[str]:
    a = auth.tenants["alpha"]
    alpha = await nats.connect(server.url, user=a.user, password=a.password,
                               inbox_prefix=inbox_prefix("alpha").encode())
    got: list[str] = []

    async def on_msg(msg: Any) -> None:
        got.append(msg.subject)

    await alpha.subscribe("pool.feedlive.alpha.>", cb=on_msg)
    await alpha.flush()
    await asyncio.to_thread(write_out, server, auth, [("alpha", "l3"), ("beta", "b3")])
    await asyncio.sleep(0.3)
    await alpha.close()
    return got


def test_a_tenant_reads_its_own_feed_live(secured: tuple[NatsServer, AuthConfig]) -> None:
    server, auth = secured
    ensure_all_streams(service_url(server, auth))
    assert asyncio.run(_alpha_follows(server, auth)) == ["pool.feedlive.alpha.lease.l3"]
