"""The recorder's memory of where each subject ends is bounded: a subject it forgot is looked
up again by its next write, and a stale writer is still refused."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import UUID

import pytest
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event
from eventsourcing.persistence import IntegrityError

import bus.jetstream.recorder as recorder_module
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


@pytest.fixture()
def app(fresh_nats: NatsServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Counters]:
    monkeypatch.setattr(recorder_module, "SUBJECT_CACHE_MAX", 8)
    a = Counters(env={"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": fresh_nats.url,
                      "NATS_STREAM": "CACHE_T"})
    yield a
    a.close()
    close_runtime(fresh_nats.url)


def test_the_subject_cache_stays_bounded_and_a_forgotten_subject_still_takes_writes(
    app: Counters,
) -> None:
    counters = [Counter(f"c{i}") for i in range(50)]
    for c in counters:
        app.save(c)
    cache = app.recorder._cache  # type: ignore[attr-defined]
    assert len(cache) <= 8
    first = counters[0]
    assert app.recorder.subject_for(first.id) not in cache  # type: ignore[attr-defined]
    # the earliest, long forgotten, takes its next write: its end is looked up again
    stale = app.repository.get(first.id)
    first.increment()
    app.save(first)
    assert app.repository.get(first.id).count == 1
    # and a writer holding an older version is refused, forgotten subject or not
    for c in counters[1:20]:
        c.increment()
        app.save(c)
    assert app.recorder.subject_for(first.id) not in cache  # type: ignore[attr-defined]
    stale.increment()
    with pytest.raises(IntegrityError):
        app.save(stale)
    assert len(cache) <= 8
