"""The dispatcher's deadline timers: what one pass over the log arms, and how it is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bus.admin import ensure_all_streams
from bus.agentbus import Armed, ControlLink
from bus.connection import connect
from bus.local.server import NatsServer
from bus.subjects import SCHEDULE_STREAM
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.dispatcher import Dispatcher
from workers.plane import ControlPlane


class _CountingLink(ControlLink):
    """A link that counts its rounds of timer publishes (each waits for its acks)."""

    rounds = 0

    def schedule_many_started(self, timers: list[tuple[str, str, float]],
                              body: bytes = b"") -> Armed:
        self.rounds += 1
        return super().schedule_many_started(timers, body)


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[ControlPlane]:
    ensure_all_streams(fresh_nats.url)
    cp = ControlPlane(fresh_nats.url, clock=FakeClock(), run_scheduler=False,
                      data_plane=False).start()
    yield cp
    cp.stop()


def _stored_subjects(url: str, prefix: str) -> set[str]:
    async def go() -> set[str]:
        nc = await connect(url)
        try:
            info = await nc.jetstream().stream_info(SCHEDULE_STREAM, subjects_filter=f"{prefix}>")
            return set((info.state.subjects or {}).keys())
        finally:
            await nc.close()

    return asyncio.run(go())


def test_the_timers_of_one_page_are_sent_together_and_each_is_stored(
        fresh_nats: NatsServer, plane: ControlPlane) -> None:
    url = fresh_nats.url
    with PoolClient(url) as admin, PoolClient(url, "alpha") as alpha:
        setup_pool(admin)
        assert admin.admin("node.register", node_body("n1"))["ok"]
        ids = alpha.request_lease({**lease_body("five"), "count": 5})["result"]["lease_ids"]
    assert plane.scheduler.cycle().placed == 5
    link = _CountingLink(url)
    dispatcher = Dispatcher(PoolApp(env=app_env(url)), link)
    try:
        assert dispatcher.step() > 0
        # five reservations' commit deadlines and the node's timeout: one round, not six
        assert link.rounds == 1 and dispatcher.timers_armed == 6
        stored = _stored_subjects(url, "pool.sched.lease.")
        assert stored == {f"pool.sched.lease.{lid}" for lid in ids}
        dispatcher.step()  # nothing new: nothing armed again
        assert link.rounds == 1 and dispatcher.timers_armed == 6
    finally:
        link.close()
        dispatcher.app.close()


def _last(url: str, subject: str) -> dict[str, str]:
    async def go() -> dict[str, str]:
        nc = await connect(url)
        try:
            return dict((await nc.jetstream().get_last_msg(SCHEDULE_STREAM, subject)).headers
                        or {})
        finally:
            await nc.close()

    return asyncio.run(go())


def _set_atomic(url: str, allow: bool) -> None:
    async def go() -> None:
        nc = await connect(url)
        try:
            js = nc.jetstream()
            config = (await js.stream_info(SCHEDULE_STREAM)).config
            config.allow_atomic = allow
            await js.update_stream(config)
        finally:
            await nc.close()

    asyncio.run(go())


def test_a_round_of_timers_is_one_atomic_batch_and_a_timer_armed_twice_keeps_its_last(
        fresh_nats: NatsServer) -> None:
    url = fresh_nats.url
    ensure_all_streams(url)
    link = ControlLink(url)
    try:
        link.schedule_many([("lease", "a", 4102444800.0), ("lease", "b", 4102444800.0),
                            ("lease", "a", 4102448400.0)])
        a, b = _last(url, "pool.sched.lease.a"), _last(url, "pool.sched.lease.b")
        assert a["Nats-Schedule"] == "@at 2100-01-01T01:00:00.000Z"
        assert b["Nats-Schedule"] == "@at 2100-01-01T00:00:00.000Z"
        assert a["Nats-Batch-Id"] == b["Nats-Batch-Id"]  # both in one batch
        assert _stored_subjects(url, "pool.sched.lease.") == {"pool.sched.lease.a",
                                                              "pool.sched.lease.b"}
        # a timer stream made before atomic batches refuses one: the timers go one by one
        _set_atomic(url, False)
        link.schedule_many([("lease", "c", 4102444800.0), ("lease", "d", 4102444800.0)])
        for name in ("c", "d"):
            headers = _last(url, f"pool.sched.lease.{name}")
            assert "Nats-Batch-Id" not in headers
            assert headers["Nats-Schedule"] == "@at 2100-01-01T00:00:00.000Z"
    finally:
        link.close()
