"""The tenants' lease feed: one record per state change, written once across restarts and
rivals, read back by a follower through replay pages and then live."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from bus.admin import ensure_all_streams
from bus.agentbus import ControlLink
from bus.connection import connect
from bus.feed import FeedConflict, FeedFollower, FeedItem, FeedWriter
from bus.local.auth import inbox_prefix
from bus.local.server import NatsServer
from bus.runtime import BusRuntime
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.dispatcher import Dispatcher
from workers.feed import FeedPublisher
from workers.plane import ControlPlane

JOB = {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, PoolClient, PoolClient]]:
    ensure_all_streams(fresh_nats.url)
    # no data plane: the only feed writers are the tests' own dispatchers
    cp = ControlPlane(fresh_nats.url, clock=FakeClock(), run_scheduler=False,
                      data_plane=False).start()
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    assert admin.admin("node.register", node_body("n1"))["ok"]
    yield cp, admin, alpha
    alpha.close()
    admin.close()
    cp.stop()


def _publisher(url: str) -> Dispatcher:
    """A dispatcher of its own (as a restarted plane has), writing the feed."""
    return Dispatcher(PoolApp(env=app_env(url)), ControlLink(url),
                      feed=FeedPublisher(FeedWriter(url, runtime=BusRuntime(url))))


def _run_lease(cp: ControlPlane, client: PoolClient, key: str) -> str:
    lid = str(client.request_lease(lease_body(key))["lease"]["lease_id"])
    assert cp.scheduler.cycle().placed == 1
    assert client.lease(lid, "commit", {"job": JOB})["ok"]
    assert client.lease(lid, "release", {"exit_code": 3})["ok"]
    return lid


def _read(url: str, tenant: str, *, lease: str | None = None, after: int = 0,
          count: int, timeout: float = 10.0) -> list[FeedItem]:
    async def go() -> list[FeedItem]:
        nc = await connect(url, inbox_prefix=inbox_prefix(tenant).encode())
        out: list[FeedItem] = []
        follower = FeedFollower(nc, tenant, lease=lease, after=after)

        async def take() -> None:
            async for item in follower.items():
                out.append(item)
                if len(out) == count:
                    return

        try:
            await asyncio.wait_for(take(), timeout)
        finally:
            await nc.close()
        return out

    return asyncio.run(go())


def test_each_state_change_of_a_lease_is_one_record_in_its_tenants_feed(
        plane: tuple[ControlPlane, PoolClient, PoolClient], fresh_nats: NatsServer) -> None:
    cp, _admin, alpha = plane
    lid = _run_lease(cp, alpha, "feed-1")
    pub = _publisher(fresh_nats.url)
    pub.step()
    items = _read(fresh_nats.url, "alpha", lease=lid, count=4)
    states = [(i.record.previous_state, i.record.state) for i in items if i.record]
    # requested and queued by one event: the lease's first record is its queueing
    assert states == [(None, "queued"), ("queued", "reserved"),
                      ("reserved", "running"), ("running", "released")]
    last = items[-1].record
    assert last is not None
    assert (last.end_reason, last.exit_code, last.node_id, last.tenant) == \
        ("failed", 3, "n1", "alpha")
    assert [i.seq for i in items] == sorted(i.seq for i in items)
    assert all(i.record and i.record.lease_id == lid for i in items)
    seqs = [i.record.log_sequence for i in items if i.record]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_a_restarted_or_rival_publisher_writes_no_record_twice(
        plane: tuple[ControlPlane, PoolClient, PoolClient], fresh_nats: NatsServer) -> None:
    cp, _admin, alpha = plane
    url = fresh_nats.url
    _run_lease(cp, alpha, "feed-a")
    first = _publisher(url)
    first.step()
    assert first.feed is not None and first.feed.records_written == 4
    # a restart: a new publisher reads the feed's position and writes nothing again
    second = _publisher(url)
    second.step()
    assert second.feed is not None and second.feed.records_written == 0
    _run_lease(cp, alpha, "feed-b")
    second.step()
    assert second.feed.records_written == 4
    # the first, still alive, folds the same events: the feed refuses its stale batch, it
    # reads where the feed stands and drops what is there
    with pytest.raises(FeedConflict):
        first.feed.writer.append([("pool.feed.alpha.lease.x", b"{}", 1)],
                                 expect_last=first.feed.feed_seq)
    first.step()
    assert first.feed.records_written == 4
    assert first.feed.feed_seq == second.feed.feed_seq == 8
    _run_lease(cp, alpha, "feed-c")
    first.step()  # now the first writes, after what the second wrote
    second.step()
    assert (first.feed.records_written, second.feed.records_written) == (8, 4)
    items = _read(url, "alpha", count=12)
    assert len({(i.record.lease_id, i.record.state) for i in items if i.record}) == 12
    assert [i.seq for i in items] == list(range(1, 13))


def test_a_follower_gets_what_is_stored_after_its_sequence_then_live_records(
        plane: tuple[ControlPlane, PoolClient, PoolClient], fresh_nats: NatsServer) -> None:
    cp, _admin, alpha = plane
    url = fresh_nats.url
    pub = _publisher(url)
    _run_lease(cp, alpha, "feed-old")
    pub.step()
    got: list[FeedItem] = []

    async def go() -> None:
        nc = await connect(url, inbox_prefix=inbox_prefix("alpha").encode())
        follower = FeedFollower(nc, "alpha", after=3)

        async def take() -> None:
            async for item in follower.items():
                got.append(item)
                if len(got) == 1:  # the rest of the old lease: now a new one, live
                    await asyncio.to_thread(_run_lease, cp, alpha, "feed-new")
                    await asyncio.to_thread(pub.step)
                if len(got) == 5:
                    return

        try:
            await asyncio.wait_for(take(), 15)
        finally:
            await nc.close()

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 15
    assert [i.seq for i in got] == list(range(4, 9))
    assert [i.record.state for i in got[1:] if i.record] == \
        ["queued", "reserved", "running", "released"]


def test_the_scheduler_process_publishes_the_feed(fresh_nats: NatsServer) -> None:
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    try:
        with PoolClient(fresh_nats.url) as admin, PoolClient(fresh_nats.url, "alpha") as alpha:
            setup_pool(admin)
            lid = str(alpha.request_lease(lease_body("feed-live"))["lease"]["lease_id"])
            items = _read(fresh_nats.url, "alpha", lease=lid, count=1, timeout=20)
            assert [i.record.state for i in items if i.record] == ["queued"]
    finally:
        cp.stop()
