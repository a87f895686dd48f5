"""The scheduler's atomic batches against a real log: sent ahead, left in flight across cycles,
refused, unanswered, and read back; never a double placement, never a lost request."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from client.api import PoolClient
from projections.decisions import check_placements
from tests.control_plane import Plane, lease_body, node_body, race, rival_schedulers, setup_pool
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.scheduler import Scheduler


def _twelve_queued_in_small_batches(plane: Plane, monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    """4 nodes of 4 cores, 12 one-core requests queued, and batches of two placements: a fresh
    scheduler that will send several batches per cycle."""
    import workers.scheduler.placing as sched

    monkeypatch.setattr(sched, "MAX_MESSAGES_PER_BATCH", 6)  # two placements a batch
    return _four_nodes(plane, queued=12)


def _four_nodes(plane: Plane, *, queued: int = 0) -> Scheduler:
    """Pool p1 with tenant alpha, 4 nodes of 4 cores, `queued` one-core requests of alpha's
    (a0, a1, ...), and a fresh scheduler that has read none of it yet."""
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0})
    for i in range(4):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=8192))
    with PoolClient(cp.nats_url, "alpha") as a:
        for i in range(queued):
            assert a.request_lease(lease_body(f"a{i}"))["ok"]
    return Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)


def _refuse_the_first_save(s: Scheduler) -> list[int]:
    """The scheduler's first batch is refused, as if a rival wrote first (it is never sent);
    later ones are sent. Returns the sizes of the saves asked for, in order."""
    from eventsourcing.persistence import IntegrityError

    real = s.app.save_nowait
    sent: list[int] = []

    class Refused:
        def wait(self) -> None:
            raise IntegrityError("a rival wrote first")

    def save_nowait(*aggs: object) -> object:
        sent.append(len(aggs))
        return Refused() if len(sent) == 1 else real(*aggs)

    s.app.save_nowait = save_nowait  # type: ignore[method-assign]
    return sent


def test_a_batch_planned_on_a_refused_one_is_dropped_unsent_and_planned_again(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:

    from domain.node import Node

    cp, _admin, clock = plane
    s = _twelve_queued_in_small_batches(plane, monkeypatch)
    _refuse_the_first_save(s)
    first = s.cycle()
    assert first.conflicts == 1  # only the refusal we made: nothing was sent on top of it
    while s.cycle().placed:
        pass
    report = check_placements(s.app)
    assert report.double_placements == 0, report.over_allocations + report.double_holds
    assert report.placements == 12  # every request placed once the log was re-read
    # a batch sent on top of the refused one would have left version gaps in its nodes'
    # histories: each node replays from the log, holding what the scheduler thinks it holds
    fresh = PoolApp(env=app_env(cp.nats_url), clock=clock)
    held = 0
    for i in range(4):
        node = fresh.repository.get(Node.create_id(f"n{i}"))
        assert node.allocations.keys() == s.aggregates[node.id].allocations.keys()
        held += len(node.allocations)
    assert held == 12
    fresh.close()
    s.app.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["settled", "pipelined"])
@pytest.mark.parametrize("priced", [False, True], ids=["free", "priced"])
def test_racing_schedulers_sending_batches_ahead_never_double_place_nor_lose_work(
    plane: Plane, monkeypatch: pytest.MonkeyPatch, priced: bool, pipelined: bool
) -> None:
    import workers.scheduler.placing as sched

    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    if priced:  # every batch also holds credits on the tenants' accounts: more to conflict on
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 3})["ok"]
    for i in range(6):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=8192))
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        for i in range(20):
            a.request_lease(lease_body(f"a{i}"))
            b.request_lease(lease_body(f"b{i}"))
    monkeypatch.setattr(sched, "MAX_MESSAGES_PER_BATCH", 6)  # many batches in flight per cycle
    rivals = rival_schedulers(cp, clock)

    def eight_cycles(s: Scheduler) -> None:
        for _ in range(8):  # pipelined: each cycle's last batch in flight while the next reads
            s.cycle(settle=not pipelined)
        s.settle()

    race(rivals, eight_cycles)
    for _ in range(3):  # whatever a conflict left queued is placed now
        rivals[0].cycle()
    report = check_placements(cp.app)
    assert report.double_placements == 0, report.over_allocations + report.double_holds
    assert report.placements == 24  # 6 nodes × 4 cores, 1 core each: the pool is full
    if priced:
        # every reserved lease holds its credits exactly once, and nothing else is held
        from domain.account import Account
        from domain.lease import Lease
        from projections.audit import CreditAudit

        fresh = PoolApp(env=app_env(cp.nats_url), clock=clock)
        reserved = {str(a.id): a.hold_microcredits for a in rivals[0].aggregates.values()
                    if isinstance(a, Lease) and a.state.value == "reserved"}
        assert len(reserved) == 24 and all(h == 600 * 3 for h in reserved.values())
        holds: dict[str, int] = {}
        for tenant in ("alpha", "beta"):
            acc = fresh.repository.get(Account.create_id(tenant))
            holds.update({str(k): v for k, v in acc.holds.items()})
            assert acc.held == sum(acc.holds.values())
        assert holds == reserved
        audit_report = CreditAudit(fresh).run()
        assert audit_report.ok, audit_report.lines()
        fresh.close()
    for s in rivals:
        s.app.close()


def test_a_rival_write_read_while_a_refused_batch_is_in_flight_is_not_lost(
    plane: Plane,
) -> None:
    """A cycle that leaves its batch in flight, then a tenant's cancel of a lease in it: the
    next cycle's read steps over the cancel (our unacknowledged batch holds that version), the
    batch is refused, and what the cycle planned on it is voided; the scheduler ends where a
    fresh replay of the log does."""

    from domain.node import Node

    cp, _admin, clock = plane
    s = _four_nodes(plane)
    sent = _refuse_the_first_save(s)  # never sent: the cancel below takes the version it expected
    with PoolClient(cp.nats_url, "alpha") as a:
        ids = [a.request_lease(lease_body(f"a{i}"))["lease"]["lease_id"] for i in range(6)]
        assert s.cycle(settle=False).placed == 6  # its batch is in flight (refused) on return
        assert a.lease(ids[0], "cancel", {})["ok"]
        for i in range(6, 8):
            assert a.request_lease(lease_body(f"a{i}"))["ok"]
    second = s.cycle(settle=False)  # reads the cancel and two requests, plans, meets the refusal
    assert second.conflicts == 1 and second.placed == 0
    assert len(sent) == 1  # what it planned on the refused batch was dropped unsent
    while s.cycle(settle=False).placed:
        pass
    s.settle()
    report = check_placements(s.app)
    assert report.double_placements == 0, report.over_allocations + report.double_holds
    assert report.placements == 7  # a1..a7; the cancelled a0 never
    fresh = Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
    fresh.catch_up()
    assert {k: (type(v).__name__, v.version) for k, v in s.aggregates.items()} == {
        k: (type(v).__name__, v.version) for k, v in fresh.aggregates.items()}
    held = set()
    for i in range(4):
        node = fresh.app.repository.get(Node.create_id(f"n{i}"))
        held |= set(node.allocations)
    assert ids[0] not in {str(k) for k in held} and len(held) == 7
    for x in (s, fresh):
        x.app.close()


def test_the_run_loop_leaves_no_batch_in_flight_when_it_stops(plane: Plane) -> None:
    from domain.lease import Lease

    cp, _admin, clock = plane
    s = _four_nodes(plane, queued=10)
    stop = threading.Event()
    cycles: list[int] = []
    real_cycle = s.cycle

    def counted(**kw: Any) -> Any:
        report = real_cycle(**kw)
        cycles.append(report.placed)
        if report.placed:
            stop.set()  # stop right after the cycle that sent the batch, before any settle
        return report

    s.cycle = counted  # type: ignore[method-assign]
    s.run(stop)
    assert cycles[-1] == 10
    assert s._inflight is None  # settled on the way out
    fresh = PoolApp(env=app_env(cp.nats_url), clock=clock)
    reserved = sum(1 for agg in s.aggregates.values()
                   if isinstance(agg, Lease) and agg.state.value == "reserved")
    assert reserved == 10 and check_placements(fresh).placements == 10
    for app in (fresh, s.app):
        app.close()


def test_the_scheduler_steps_over_its_own_batches_and_still_reads_everyone_elses(
    plane: Plane,
) -> None:
    from projections.replay import notifications

    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0})
    for i in range(4):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=8192))
    s = Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
    with PoolClient(cp.nats_url, "alpha") as a:
        for i in range(6):
            assert a.request_lease(lease_body(f"a{i}"))["ok"]
        s.catch_up()
        before = s.position
        assert s.cycle().placed == 6
        for i in range(6, 9):  # others write after our batch
            assert a.request_lease(lease_body(f"a{i}"))["ok"]
    log = list(notifications(s.app, before + 1))
    ours = sum(n.topic.endswith(("LeaseReserved", "CapacityAllocated",
                                 "CapacityAllocatedBatch", "CreditsHeld")) for n in log)
    assert ours >= 7  # 6 reservations, and one event per node placed on
    assert s.catch_up() == len(log) - ours  # only the others' events were read
    assert s.position == log[-1].id
    fresh = Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
    fresh.catch_up()
    assert {k: (type(v).__name__, v.version) for k, v in s.aggregates.items()} == {
        k: (type(v).__name__, v.version) for k, v in fresh.aggregates.items()}
    assert s.cycle().placed == 3
    for x in (s, fresh):
        x.app.close()


def test_a_save_with_no_answer_fails_the_cycle_and_leaves_no_unsaved_event_behind(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bus.errors import BusTimeout
    from domain.node import Node

    cp, _admin, clock = plane
    s = _twelve_queued_in_small_batches(plane, monkeypatch)
    real = s.app.save_nowait

    class Unanswered:
        def wait(self) -> None:
            raise BusTimeout("save not acknowledged")

    calls: list[int] = []

    def save_nowait(*aggs: object) -> object:
        calls.append(len(aggs))
        return Unanswered() if len(calls) == 1 else real(*aggs)

    s.app.save_nowait = save_nowait  # type: ignore[method-assign]
    with pytest.raises(BusTimeout):
        s.cycle()
    # the batch planned on the unanswered one was never sent, and its events were dropped
    assert len(calls) == 1
    assert not any(agg._pending_events for agg in s.aggregates.values())  # type: ignore[attr-defined]
    while s.cycle().placed:
        pass
    report = check_placements(s.app)
    assert report.double_placements == 0, report.over_allocations + report.double_holds
    assert report.placements == 12
    fresh = PoolApp(env=app_env(cp.nats_url), clock=clock)
    for i in range(4):
        node = fresh.repository.get(Node.create_id(f"n{i}"))
        assert node.allocations.keys() == s.aggregates[node.id].allocations.keys()
    fresh.close()
    s.app.close()


def _sixteen_queued_past_the_recorders_memory(plane: Plane,
                                              monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    """16 one-core requests queued on 4 nodes of 4 cores, two placements a batch, read by a
    scheduler whose recorder remembers at most 16 subject ends: the first read are forgotten
    by the time they are placed."""
    import bus.jetstream.logreader as logreader_module
    import bus.jetstream.subjectcache as subjectcache_module
    import workers.scheduler.placing as sched

    for module in (subjectcache_module, logreader_module):  # the reads' bound too
        monkeypatch.setattr(module, "SUBJECT_CACHE_MAX", 16)
    monkeypatch.setattr(sched, "MAX_MESSAGES_PER_BATCH", 6)
    s = _four_nodes(plane, queued=16)
    s.catch_up()
    return s


def test_a_backlog_past_the_recorders_memory_is_saved_without_looking_up_its_leases(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the ends of the forgotten ones come from the scheduler's own record of each request,
    # not from a read of the log before each save
    s = _sixteen_queued_past_the_recorders_memory(plane, monkeypatch)
    leases = {str(lid) for lid in s.aggregates.queued}
    assert len(leases) == 16
    recorder: Any = s.app.recorder
    looked_up: list[str] = []
    many, single = recorder._look_up_many, recorder._subject_state

    async def counted_many(subjects: list[str]) -> None:
        looked_up.extend(subjects)
        await many(subjects)

    async def counted_single(subject: str) -> Any:
        looked_up.append(subject)
        return await single(subject)

    monkeypatch.setattr(recorder, "_look_up_many", counted_many)
    monkeypatch.setattr(recorder, "_subject_state", counted_single)
    assert s.cycle().placed == 16
    assert not [subject for subject in looked_up if subject.rsplit(".", 1)[-1] in leases]


def test_a_stale_end_told_to_the_recorder_is_refused_as_a_conflict(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a hint older than the log (another writer came first) is an expectation the server
    # refuses: the batch is voided and its requests placed again from what the log says
    s = _sixteen_queued_past_the_recorders_memory(plane, monkeypatch)
    leases = list(s.aggregates.queued)
    for record in s.aggregates.queued.values():
        record.end -= 1  # as if each had been read one event short of the subject's end
    conflicts = sum(s.cycle().conflicts for _ in range(4))
    assert conflicts >= 1
    states = [str(s.app.repository.get(lid).state) for lid in leases]
    assert states == ["reserved"] * 16, states
