"""Group commit: concurrent saves share atomic batches, and each caller gets its own answer.

Judged from the log by replay (projections.decisions): nothing lost, nothing applied twice, every
conflict answered to the caller whose expectation failed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event
from eventsourcing.persistence import IntegrityError

from bus.local.server import NatsServer
from bus.runtime import close_runtime
from projections.decisions import count_events


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


def make_app(server: NatsServer) -> Counters:
    return Counters(env={"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": server.url,
                         "NATS_STREAM": "GROUP_T"})


@pytest.fixture()
def server(fresh_nats: NatsServer) -> Iterator[NatsServer]:
    yield fresh_nats
    close_runtime(fresh_nats.url)


def _concurrently(calls: list[Any]) -> list[Any]:
    """Run each call on its own thread, released together; each one's result or error."""
    out: list[Any] = [None] * len(calls)
    gate = threading.Barrier(len(calls))

    def run(i: int) -> None:
        gate.wait()
        try:
            out[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 - the caller's answer, judged by the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_concurrent_saves_of_disjoint_aggregates_share_batches_and_all_land_once(
        server: NatsServer) -> None:
    app = make_app(server)
    counters = [Counter(f"c{i}") for i in range(40)]
    app.save(*counters)
    for c in counters:
        c.increment()

    def save(c: Counter) -> Any:
        return lambda: app.save(c)

    answers = _concurrently([save(c) for c in counters])
    assert not [a for a in answers if isinstance(a, Exception)]
    group = app.recorder._group  # type: ignore[attr-defined]
    # 40 saves in fewer round trips: some rode a batch or a round of plain publishes together
    # (a lone save would take one each)
    assert group.saves == 1 + 40 and group.batches + group.rounds < 1 + 40
    # the log by replay: each increment exactly once, and every counter reads back right
    assert count_events(app, {"Incremented"}) == {
        ("Incremented", str(c.id)): 1 for c in counters}
    fresh = make_app(server)
    assert all(fresh.repository.get(c.id).count == 1 for c in counters)


def test_concurrent_saves_of_one_aggregate_let_one_win_and_answer_the_others_a_conflict(
        server: NatsServer) -> None:
    app = make_app(server)
    shared = Counter("shared")
    others = [Counter(f"o{i}") for i in range(10)]
    app.save(shared, *others)
    copies = [app.repository.get(shared.id) for _ in range(10)]  # the same version, ten times
    for c in [*copies, *others]:
        c.increment()

    def save(c: Counter) -> Any:
        return lambda: app.save(c)

    answers = _concurrently([save(c) for c in [*copies, *others]])
    on_shared, on_others = answers[:10], answers[10:]
    assert sum(1 for a in on_shared if not isinstance(a, Exception)) == 1
    assert all(isinstance(a, IntegrityError) for a in on_shared if isinstance(a, Exception))
    assert not [a for a in on_others if isinstance(a, Exception)]
    counts = count_events(app, {"Incremented"})
    assert counts[("Incremented", str(shared.id))] == 1
    assert all(counts[("Incremented", str(o.id))] == 1 for o in others)


def _stale_and_fresh(server: NatsServer) -> tuple[Counters, list[Any], list[Counter], Counter]:
    """Six single-event saves, the third (on `stale`) expecting an end another writer has
    moved past: (the app, the saves, the five fresh counters, the stale one)."""
    app, elsewhere = make_app(server), make_app(server)
    stale = Counter("stale")
    fresh = [Counter(f"f{i}") for i in range(5)]
    app.save(stale, *fresh)
    mine = app.repository.get(stale.id)  # read here: this recorder now expects its end
    theirs = elsewhere.repository.get(stale.id)
    theirs.increment()
    elsewhere.save(theirs)  # another writer moves it on: this recorder does not know
    mine.increment()
    for f in fresh:
        f.increment()
    saves = [[app.mapper.to_stored_event(e) for e in agg.collect_events()]
             for agg in [*fresh[:2], mine, *fresh[2:]]]
    return app, saves, fresh, stale


def _insert_at_once(app: Counters, saves: list[Any]) -> list[Any]:
    rec: Any = app.recorder
    group = rec._group

    async def all_at_once() -> list[Any]:
        # queued in one loop turn: the first round carries all six
        return list(await asyncio.gather(*(group.insert(s) for s in saves),
                                         return_exceptions=True))

    return rec.runtime.run(all_at_once(), 30)  # type: ignore[no-any-return]


def _judge(app: Counters, answers: list[Any], fresh: list[Counter], stale: Counter) -> None:
    """The stale save alone refused; the others stored once each, where their ids say."""
    assert isinstance(answers[2], IntegrityError)
    ids = [a for i, a in enumerate(answers) if i != 2]
    assert all(isinstance(a, list) and len(a) == 1 for a in ids)
    assert len({a[0] for a in ids}) == 5  # each its own position in the log
    counts = count_events(app, {"Incremented"})
    assert counts[("Incremented", str(stale.id))] == 1  # the other writer's, not ours
    assert all(counts[("Incremented", str(f.id))] == 1 for f in fresh)
    by_id = {n.id: n for n in app.recorder.select_notifications(1, 100)}
    for agg, answer in zip(fresh, ids, strict=True):
        assert by_id[answer[0]].originator_id == agg.id


def test_a_small_round_of_single_event_saves_goes_as_plain_publishes_each_answered_alone(
        server: NatsServer) -> None:
    """Six saves of one event each: one round of plain publishes, no atomic batch; the
    stale one is refused by the server alone and the other five are stored."""
    app, saves, fresh, stale = _stale_and_fresh(server)
    group: Any = app.recorder._group  # type: ignore[attr-defined]
    batches, rounds = group.batches, group.rounds
    answers = _insert_at_once(app, saves)
    _judge(app, answers, fresh, stale)
    assert group.rounds - rounds == 1 and group.batches == batches
    assert group.refused_messages == 1 and group.refused_batches == 0


def test_a_batch_refused_for_one_stale_expectation_answers_the_rest(
        server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from bus.jetstream import groupcommit

    monkeypatch.setattr(groupcommit, "EACH_AT_MOST", 0)  # every round an atomic batch
    app, saves, fresh, stale = _stale_and_fresh(server)
    group: Any = app.recorder._group  # type: ignore[attr-defined]
    before = group.batches
    answers = _insert_at_once(app, saves)
    _judge(app, answers, fresh, stale)
    # refused whole, sorted out, and the five sent again in a second batch
    assert group.refused_batches >= 1 and group.batches - before == 2
    assert group.rounds == 0
