"""The dispatcher's checkpoint against a real log: restored and folded to the end it equals a
full replay, lease feed included; a feed short of it, or a scheduler's checkpoint put in its
place, is refused and the replay is full."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from bus.agentbus import POSITIONS_BUCKET, ControlLink
from bus.checkpoints import CheckpointStore
from bus.feed import POSITION_KEY as FEED_POSITION
from bus.feed import FeedWriter
from bus.local.server import NatsServer
from bus.runtime import BusRuntime
from bus.subjects import FEED_STREAM
from client.api import PoolClient
from tests.control_plane import FakeClock, start
from tests.integration.test_scheduler_checkpoint import (
    KEY,
    Plane,
    _first_half,
    _scheduler,
    _second_half,
)
from tests.scheduler_state import differences, plain
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.dispatcher import Dispatcher
from workers.feed import FeedPublisher
from workers.scheduler.checkpoint import Checkpointer


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    CheckpointStore(fresh_nats.url).ensure()
    yield cp, admin, clock
    admin.close()
    cp.stop()


def _dispatcher(url: str, key: bytes | None = KEY) -> Dispatcher:
    d = Dispatcher(PoolApp(env=app_env(url)), ControlLink(url),
                   feed=FeedPublisher(FeedWriter(url, runtime=BusRuntime(url))))
    if key is not None:
        d.checkpoints = Checkpointer(CheckpointStore(url, name="dispatcher"), key,
                                     purpose="dispatcher")
    return d


def _fold(d: Dispatcher) -> dict[str, Any]:
    assert d.feed is not None
    return {"position": d.position, "pools": plain(d.pools), "armed": plain(d._armed),
            "aggregates": {str(k): plain(v) for k, v in sorted(d.aggregates.items(),
                                                                 key=lambda kv: kv[0])},
            "queued": sorted(str(k) for k in d.aggregates.queued),
            "feed_last": plain(d.feed._last)}


def _assert_same(a: Dispatcher, b: Dispatcher) -> None:
    x, y = _fold(a), _fold(b)
    diff = differences(x, y)
    assert not diff, "\n".join(diff)
    assert x == y


def _close(*ds: Dispatcher) -> None:
    for d in ds:
        d.app.close()


def test_a_dispatchers_fold_checkpointed_mid_log_equals_the_full_replay(plane: Plane) -> None:
    cp, admin, clock = plane
    ids = _first_half(cp, admin, clock)
    writer = _dispatcher(cp.nats_url)
    writer.step()
    assert writer.checkpoints is not None and writer.checkpoints.write_now(writer)
    middle = writer.position
    assert writer.aggregates and writer._armed
    _second_half(cp, admin, clock, ids)
    restored, replayed = _dispatcher(cp.nats_url), _dispatcher(cp.nats_url, key=None)
    try:
        restored.step()
        replayed.step()
        assert restored.checkpoints is not None and restored.checkpoints.restored_at == middle
        assert restored.position == replayed.position > middle
        _assert_same(restored, replayed)
    finally:
        _close(writer, restored, replayed)


def test_a_feed_short_of_the_checkpoint_makes_the_dispatcher_replay_from_the_start(
        plane: Plane, caplog: pytest.LogCaptureFixture) -> None:
    cp, admin, clock = plane
    ids = _first_half(cp, admin, clock)
    writer = _dispatcher(cp.nats_url)
    writer.step()
    assert writer.checkpoints is not None and writer.checkpoints.write_now(writer)
    _second_half(cp, admin, clock, ids)
    cp.stop()  # its own dispatcher would write the feed again

    async def purge() -> None:  # the feed reset: its records and its saved position gone
        js = await rt.jetstream()
        await js.purge_stream(FEED_STREAM)
        kv = await js.key_value(POSITIONS_BUCKET)
        await kv.purge(FEED_POSITION)

    rt = BusRuntime(cp.nats_url)
    rt.run(purge())
    restored, replayed = _dispatcher(cp.nats_url), _dispatcher(cp.nats_url, key=None)
    try:
        with caplog.at_level(logging.WARNING):
            restored.step()
        assert restored.checkpoints is not None and restored.checkpoints.restored_at is None
        assert any("short of the checkpoint" in r.getMessage() for r in caplog.records)
        replayed.step()
        _assert_same(restored, replayed)
    finally:
        _close(writer, restored, replayed)


def test_a_schedulers_checkpoint_is_not_a_dispatchers(
        plane: Plane, caplog: pytest.LogCaptureFixture) -> None:
    cp, admin, clock = plane
    _first_half(cp, admin, clock)
    scheduler = _scheduler(cp, clock)
    scheduler.catch_up()
    assert scheduler.checkpoints is not None and scheduler.checkpoints.write_now(scheduler)
    got = CheckpointStore(cp.nats_url).get()
    assert got is not None
    CheckpointStore(cp.nats_url, name="dispatcher").put(*got)
    d = _dispatcher(cp.nats_url)
    try:
        with caplog.at_level(logging.WARNING, logger="workers.scheduler.checkpoint"):
            d.step()
        assert d.checkpoints is not None and d.checkpoints.restored_at is None
        assert any("does not verify" in r.getMessage() for r in caplog.records)
    finally:
        scheduler.close()
        scheduler.app.close()
        _close(d)
