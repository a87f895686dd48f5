"""A direct get's answer aimed at a live subject (not stored: delivered to whoever listens
there, with the asker's own body and headers) is never taken as a job's output, a feed record or
a session's bytes. The stored answers are tests/security/test_reply_junk.py's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from bus.junk import junk_values
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.replies import tenant_inbox
from tests.security.test_reply_junk import Plane, aim_live, made_plane


@pytest.fixture()
def plane(secured: tuple[NatsServer, AuthConfig]) -> Iterator[Plane]:
    yield made_plane(secured)


# -- a tenant's live telemetry ------------------------------------------------------------------

def test_a_direct_gets_answer_on_a_tenants_live_output_is_no_sample(plane: Plane) -> None:
    import json

    from bus.telemetry_follow import follow_telemetry

    server, auth, _ = plane
    subject = "pool.tel.p1.gpu-7.beta.l1.output"

    def sample(text: str) -> bytes:
        return json.dumps({"kind": "output", "at": 1.0, "attrs": {"text": text}}).encode()

    async def go() -> list[Any]:
        b, n = auth.tenants["beta"], auth.nodes["gpu-7"]
        beta = await nats.connect(server.url, user=b.user, password=b.password,
                                  inbox_prefix=tenant_inbox("beta").encode())
        node = await nats.connect(server.url, user=n.user, password=n.password)
        got: list[Any] = []
        ready = asyncio.Event()

        async def on_sample(s: Any) -> None:
            got.append(s)

        task = asyncio.ensure_future(follow_telemetry(
            beta, on_sample, filter_subject="pool.tel.*.*.beta.>", max_samples=1,
            on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 10)
        # alpha's own text, answered on beta's lease output; then the node's real line
        await asyncio.to_thread(aim_live, plane, subject, sample("forged by alpha"))
        await asyncio.sleep(0.3)
        await node.publish(subject, sample("the job's line"))
        await asyncio.wait_for(task, 10)
        await beta.close()
        await node.close()
        return got

    before = junk_values().count
    got = asyncio.run(go())
    assert [s.event.attrs["text"] for s in got] == ["the job's line"]
    assert junk_values().count > before


def test_a_direct_gets_answer_on_a_leases_output_is_not_printed_by_lease_run(
        plane: Plane) -> None:
    import json
    import queue

    from bus.leasewatch import LeaseWatch, Output
    from bus.subjects import output_filter

    server, auth, _ = plane
    subject = "pool.tel.p1.gpu-7.beta.l1.output"
    watch = LeaseWatch(None, "beta", "l1", output=True)  # type: ignore[arg-type]
    watch._gate.placed("gpu-7")  # as once the feed named the lease's node

    def sample(text: str) -> bytes:
        return json.dumps({"kind": "output", "at": 1.0, "attrs": {"text": text}}).encode()

    async def go() -> None:
        b, n = auth.tenants["beta"], auth.nodes["gpu-7"]
        beta = await nats.connect(server.url, user=b.user, password=b.password,
                                  inbox_prefix=tenant_inbox("beta").encode())
        node = await nats.connect(server.url, user=n.user, password=n.password)
        # the subscription `pool lease run` makes, its messages handed to the watch
        await beta.subscribe(output_filter("beta", "l1"), cb=watch._on_output)
        await beta.flush()
        await asyncio.to_thread(aim_live, plane, subject, sample("forged by alpha"))
        await node.publish(subject, sample("the job's line"))
        await node.flush()
        await asyncio.sleep(0.5)
        await beta.close()
        await node.close()

    before = junk_values().count
    asyncio.run(go())
    printed = []
    with contextlib.suppress(queue.Empty):
        while True:
            item = watch._queue.get_nowait()
            assert isinstance(item, Output)
            printed.append(item.text)
    assert printed == ["the job's line"]
    assert junk_values().count > before


def test_a_direct_gets_answer_is_neither_output_nor_a_record_to_the_lean_lease_run(
        plane: Plane) -> None:
    """The same two forgeries against `pool lease run`'s core-NATS watch (bus.leanwatch)."""
    import json

    from bus.corenats import Connection
    from bus.leanwatch import LeanLeaseWatch
    from bus.leaseitems import Output
    from bus.subjects import FEED_LIVE_PREFIX, feed_filter, output_filter
    from tests.security.test_feed import _record

    server, auth, _ = plane
    subject = "pool.tel.p1.gpu-7.beta.l1.output"
    b, n = auth.tenants["beta"], auth.nodes["gpu-7"]
    conn = Connection(server.url, user=b.user, password=b.password,
                      inbox_prefix=tenant_inbox("beta"))
    watch = LeanLeaseWatch(conn, "beta", "l1", output=True)
    # the subscriptions start() makes, without its replay (no command service here)
    watch._sids = (conn.subscribe(output_filter("beta", "l1")),
                   conn.subscribe(feed_filter("beta", "l1", live=True)))
    conn.flush()
    watch._gate.placed("gpu-7")  # as once the feed named the lease's node

    def sample(text: str) -> bytes:
        return json.dumps({"kind": "output", "at": 1.0, "attrs": {"text": text}}).encode()

    before = junk_values().count
    aim_live(plane, f"{FEED_LIVE_PREFIX}.beta.lease.l1", _record("beta", "l1"))
    aim_live(plane, subject, sample("forged by alpha"))

    async def node_line() -> None:
        node = await nats.connect(server.url, user=n.user, password=n.password)
        await node.publish(subject, sample("the job's line"))
        await node.flush()
        await node.close()

    asyncio.run(node_line())
    got = []
    while (item := watch.get(timeout=1.0)) is not None:
        got.append(item)
    conn.close()
    assert [i.text for i in got if isinstance(i, Output)] == ["the job's line"]
    assert [i for i in got if not isinstance(i, Output)] == [], "a forged feed record was taken"
    assert junk_values().count >= before


# -- an exec or attach session's bytes ----------------------------------------------------------

def test_a_direct_gets_answer_on_a_sessions_subjects_reaches_neither_end(
        plane: Plane) -> None:
    from bus.agentbus import AgentLink
    from bus.sessions import STDIN, STDOUT, TenantSession, frame

    server, auth, _ = plane
    inn, out = "pool.sess.beta.gpu-7.s1.in", "pool.sess.beta.gpu-7.s1.out"
    link = AgentLink(url_with_credentials(server.url, auth.nodes["gpu-7"]), "gpu-7").connect()
    into_job: list[bytes] = []
    end = link.subscribe(inn, lambda _s, data: into_job.append(data))  # the agent's end

    async def go() -> list[Any]:
        b, n = auth.tenants["beta"], auth.nodes["gpu-7"]
        beta = await nats.connect(server.url, user=b.user, password=b.password,
                                  inbox_prefix=tenant_inbox("beta").encode())
        node = await nats.connect(server.url, user=n.user, password=n.password)
        session = TenantSession(beta, "beta", "l1", session_id="s1")
        session.node = "gpu-7"  # as once the plane named it
        await beta.subscribe(out, cb=session._on_msg)  # the tenant's end
        await beta.flush()
        for subject, kind in ((inn, STDIN), (out, STDOUT)):  # alpha's bytes, both ways
            await asyncio.to_thread(aim_live, plane, subject, frame(kind, b"rm -rf ~\n"))
        await beta.publish(inn, frame(STDIN, b"ls\n"))
        await node.publish(out, frame(STDOUT, b"file\n"))
        await asyncio.sleep(0.5)
        frames = []
        while not session._frames.empty():
            frames.append(session._frames.get_nowait())
        await beta.close()
        await node.close()
        return frames

    before = junk_values().count
    try:
        frames = asyncio.run(go())
    finally:
        end()
        link.close()
    assert into_job == [frame(STDIN, b"ls\n")]
    assert [payload for _kind, _conn, payload in frames] == [b"file\n"]
    assert junk_values().count > before
