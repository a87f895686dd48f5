"""An eventsourcing Application on `PERSISTENCE_MODULE=bus.jetstream` against a real nats-server.

Owns the end-to-end guarantees: all-or-nothing saves, stale writers refused, size limit, durability.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from uuid import NAMESPACE_URL, UUID, uuid5

import pytest
from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.domain import Aggregate, event
from eventsourcing.persistence import IntegrityError

from bus.errors import BatchTooLarge, BusError
from bus.local.server import NatsServer
from bus.runtime import close_runtime


class Counter(Aggregate):
    @event("Created")
    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0

    @event("Incremented")
    def increment(self) -> None:
        self.count += 1


class Counters(Application[UUID]):
    pass


def make_app(server: NatsServer, stream: str = "ATOMIC_T") -> Counters:
    return Counters(
        env={
            "PERSISTENCE_MODULE": "bus.jetstream",
            "NATS_URL": server.url,
            "NATS_STREAM": stream,
        }
    )


@pytest.fixture()
def server(fresh_nats: NatsServer) -> Iterator[NatsServer]:
    yield fresh_nats
    # the runtime would otherwise keep reconnecting to a server that is gone
    close_runtime(fresh_nats.url)


def test_three_aggregates_in_one_save_land_all_or_nothing(server: NatsServer) -> None:
    app = make_app(server)
    c = Counter("c")
    app.save(c)

    # a stale copy of c: someone else saved a newer version after we read it
    stale = app.repository.get(c.id)
    fresh = app.repository.get(c.id)
    fresh.increment()
    app.save(fresh)

    a, b = Counter("a"), Counter("b")
    stale.increment()
    before = app.recorder.max_notification_id()
    with pytest.raises(IntegrityError):
        app.save(a, b, stale)

    for agg in (a, b):
        with pytest.raises(AggregateNotFoundError):
            app.repository.get(agg.id)
    assert app.repository.get(c.id).version == 2
    assert app.recorder.max_notification_id() == before

    # the same three, none stale, land together with contiguous notification ids
    a2, b2 = Counter("a2"), Counter("b2")
    current = app.repository.get(c.id)
    current.increment()
    recordings = app.save(a2, b2, current)
    ids = [r.notification.id for r in recordings]
    assert ids == list(range(ids[0], ids[0] + 3))
    assert app.repository.get(a2.id).name == "a2"
    assert app.repository.get(c.id).count == 2


def test_a_stale_writer_in_another_process_is_refused(server: NatsServer) -> None:
    # two applications = two recorders with caches of their own, as in two processes
    app1, app2 = make_app(server), make_app(server)
    c = Counter("shared")
    app1.save(c)

    copy1 = app1.repository.get(c.id)
    copy2 = app2.repository.get(c.id)
    copy1.increment()
    app1.save(copy1)
    copy2.increment()
    with pytest.raises(IntegrityError):
        app2.save(copy2)  # refused by the server's expected-last-subject-sequence check
    # after the refusal app2 re-reads and can write on top of the winner
    again = app2.repository.get(c.id)
    assert again.count == 1
    again.increment()
    app2.save(again)
    assert app1.repository.get(c.id).count == 2


class Named(Aggregate):
    """An aggregate whose id comes from its name (as accounts and nodes are found)."""

    @staticmethod
    def create_id(name: str) -> UUID:
        return uuid5(NAMESPACE_URL, f"urn:test:named:{name}")

    @event("Created")
    def __init__(self, name: str, by: str) -> None:
        self.name = name
        self.by = by


def test_a_second_creation_of_the_same_aggregate_is_refused_alone_and_in_a_batch(
    server: NatsServer,
) -> None:
    """A first event (version 1) is saved expecting its subject empty, without looking first:
    when another process created the same aggregate, this save is refused as a conflict,
    alone or inside a batch, and nothing of the refused batch lands."""
    app1, app2 = make_app(server), make_app(server)
    app1.save(Named("x", by="app1"))
    with pytest.raises(IntegrityError):
        app2.save(Named("x", by="app2"))
    bystander = Counter("bystander")
    with pytest.raises(IntegrityError):
        app2.save(bystander, Named("x", by="app2 again"))
    assert app1.repository.get(Named.create_id("x")).by == "app1"
    with pytest.raises(AggregateNotFoundError):
        app1.repository.get(bystander.id)
    # and a new one goes through, from either
    app2.save(Named("y", by="app2"))
    assert app1.repository.get(Named.create_id("y")).by == "app2"


def test_a_1001_event_save_raises_batch_too_large(server: NatsServer) -> None:
    app = make_app(server)
    big = Counter("big")  # 1 creation + 1000 increments
    for _ in range(1000):
        big.increment()
    with pytest.raises(BatchTooLarge, match="1001"):
        app.save(big)
    with pytest.raises(AggregateNotFoundError):
        app.repository.get(big.id)

    # 1000 is allowed
    ok = Counter("ok")
    for _ in range(999):
        ok.increment()
    app.save(ok)
    assert app.repository.get(ok.id).count == 999


def _retry(fn: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except BusError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_events_survive_a_server_restart(server: NatsServer) -> None:
    app = make_app(server)
    c = Counter("durable")
    c.increment()
    c.increment()
    app.save(c)
    last = app.recorder.max_notification_id()

    server.stop()
    server.start()  # same store dir and port

    # the factory re-ensures the stream on a server still recovering: it must not wipe it
    app2 = _retry(lambda: make_app(server))
    got = _retry(lambda: app2.repository.get(c.id))
    assert got.count == 2 and got.name == "durable"
    assert _retry(app2.recorder.max_notification_id) == last
    # and writing continues where it left off
    got.increment()
    _retry(lambda: app2.save(got))
    assert app.repository.get(c.id).count == 3


def test_a_closed_runtime_refuses_new_work_at_once(server: NatsServer) -> None:
    """`submit` on a closed runtime raises as `run` does, instead of a future that a stopped
    loop would never finish (a reader waiting on it would wait forever)."""
    from bus.runtime import BusRuntime

    rt = BusRuntime(server.url)

    async def nothing() -> int:
        return 1

    assert rt.submit(nothing()).result(5) == 1
    rt.close()
    with pytest.raises(BusError):
        rt.submit(nothing())
    with pytest.raises(BusError):
        rt.run(nothing())
