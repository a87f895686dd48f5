"""The recorder's memory of where each subject ends is bounded: a subject it forgot is looked
up again by its next write, and a stale writer is still refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from uuid import UUID

import pytest
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event
from eventsourcing.persistence import IntegrityError

import bus.jetstream.subjectcache as subjectcache_module
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
    monkeypatch.setattr(subjectcache_module, "SUBJECT_CACHE_MAX", 8)
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


@pytest.fixture()
def cached_app(fresh_nats: NatsServer) -> Iterator[Counters]:
    a = Counters(env={"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": fresh_nats.url,
                      "NATS_STREAM": "CACHE_T", "AGGREGATE_CACHE_MAXSIZE": "100"})
    yield a
    a.close()
    close_runtime(fresh_nats.url)


def _count_scanned(app: Counters, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Messages each fast-forward read of a subject went through."""
    scanned: list[int] = []
    scan = app.recorder._scan  # type: ignore[attr-defined]

    async def counting(*args: object) -> object:
        scanned.append(0)
        async for m in scan(*args):
            scanned[-1] += 1
            yield m

    monkeypatch.setattr(app.recorder, "_scan", counting)
    return scanned


def test_a_cached_copy_fast_forwards_past_our_own_last_save_not_from_the_subject_start(
    cached_app: Counters, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the library caches the copy it loaded, not the one it saved: after our save the copy
    # is one version behind the subject's end we know, and was read from the subject's start
    c = Counter("busy")
    cached_app.save(c)
    scanned = _count_scanned(cached_app, monkeypatch)
    for _ in range(40):
        copy = cached_app.repository.get(c.id)
        copy.increment()
        cached_app.save(copy)
    assert cached_app.repository.get(c.id).count == 40
    assert max(scanned) <= 2, scanned


def test_a_retry_after_a_conflict_reads_only_what_came_after_its_copy(
    cached_app: Counters, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = Counter("contended")
    cached_app.save(c)
    for _ in range(30):
        copy = cached_app.repository.get(c.id)
        copy.increment()
        cached_app.save(copy)
    stale = cached_app.repository.get(c.id)
    other = cached_app.repository.get(c.id)
    other.increment()
    cached_app.save(other)  # another writer got there first
    stale.increment()
    with pytest.raises(IntegrityError):
        cached_app.save(stale)
    scanned = _count_scanned(cached_app, monkeypatch)
    again = cached_app.repository.get(c.id)  # the retry's load
    assert again.count == 31
    assert scanned and max(scanned) <= 2, scanned


def test_the_subject_cache_forgets_the_least_recently_used_and_what_it_is_told_to(
    app: Counters,
) -> None:
    hot = Counter("hot")
    app.save(hot)
    for i in range(30):  # many others come and go; the hot one is written between them
        app.save(Counter(f"cold{i}"))
        hot.increment()
        app.save(hot)
    cache = app.recorder._cache  # type: ignore[attr-defined]
    subject = app.recorder.subject_for(hot.id)  # type: ignore[attr-defined]
    assert subject in cache and len(cache) <= 8
    app.recorder.forget(hot.id)  # type: ignore[attr-defined]
    app.recorder.runtime.run(asyncio.sleep(0))  # type: ignore[attr-defined]
    assert subject not in cache
    hot.increment()
    app.save(hot)  # looked up again
    assert app.repository.get(hot.id).count == 31



def test_many_forgotten_subjects_in_one_save_are_looked_up_together(
    fresh_nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a scheduler's batch of leases it only read, their ends long forgotten: one multi-subject
    # read per few hundred subjects, not one request each; a stale writer is still refused
    monkeypatch.setattr(subjectcache_module, "SUBJECT_CACHE_MAX", 400)
    app = Counters(env={"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": fresh_nats.url,
                        "NATS_STREAM": "CACHE_M"})
    try:
        counters = [Counter(f"c{i}") for i in range(1000)]
        for c in counters[:40]:
            c.increment()  # some written twice: their ends are at version 2
        for at in range(0, len(counters), 100):
            app.save(*counters[at:at + 100])
        cache = app.recorder._cache  # type: ignore[attr-defined]
        assert len(cache) <= 400
        assert app.recorder.subject_for(counters[0].id) not in cache  # type: ignore[attr-defined]
        stale = app.repository.get(counters[5].id)
        reads: list[dict[str, object]] = []
        singles: list[str] = []
        direct_get = app.recorder._direct_get  # type: ignore[attr-defined]
        subject_state = app.recorder._subject_state  # type: ignore[attr-defined]

        async def counted(req: dict[str, object]) -> object:
            reads.append(req)
            return await direct_get(req)

        async def single(subject: str) -> object:
            singles.append(subject)
            return await subject_state(subject)

        app.recorder._direct_get = counted  # type: ignore[attr-defined]
        app.recorder._subject_state = single  # type: ignore[attr-defined]
        for c in counters[:290]:
            c.increment()
        app.save(*counters[:290])
        assert len(reads) == 2 and not singles, (len(reads), len(singles))
        assert [app.repository.get(c.id).count for c in counters[:300:20]] == [2, 2] + [1] * 13
        stale.increment()
        with pytest.raises(IntegrityError):
            app.save(stale)
    finally:
        app.close()
        close_runtime(fresh_nats.url)
