"""The scheduler against a real log: fair share, reasons, credits, quotas, and no double placement."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from bus.local.server import NatsServer
from chaos.invariants import check_placements
from client.api import PoolClient
from control.application import PoolApp
from control.bootstrap import app_env
from control.plane import ControlPlane
from control.scheduler import Scheduler
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start

Plane = tuple[ControlPlane, PoolClient, FakeClock]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    yield cp, admin, clock
    admin.close()
    cp.stop()


def _placed_by_tenant(cp: ControlPlane) -> Counter[str]:
    out: Counter[str] = Counter()
    for agg in cp.scheduler.aggregates.values():
        if type(agg).__name__ == "Lease" and agg.state.value == "reserved":  # type: ignore[attr-defined]
            out[agg.tenant_id] += 1  # type: ignore[attr-defined]
    return out


def test_weighted_fair_share_splits_a_full_pool_by_weight(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, tenants={"alpha": 2.0, "beta": 1.0})
    for i in range(3):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=4096))
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        for i in range(12):  # each wants far more than the pool's 12 cores
            assert a.request_lease(lease_body(f"a{i}"))["ok"]
            assert b.request_lease(lease_body(f"b{i}"))["ok"]
    cp.scheduler.cycle()
    placed = _placed_by_tenant(cp)
    assert placed == {"alpha": 8, "beta": 4}  # DRF with weights 2:1 over 12 equal slots


def test_a_request_no_node_could_ever_hold_is_rejected_with_filter_counts(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("cpu1"))
    admin.admin("node.register", node_body("gpu1", gpu_count=2, gpu_model="a100", gpu_memory_gib=40))
    with PoolClient(cp.nats_url, "alpha") as a:
        lid = a.request_lease(lease_body("huge-gpu", gpu_count=1, gpu_memory_gib_min=80))["lease"]["lease_id"]
        assert cp.scheduler.cycle().rejected == 1
        assert a.lease(lid, "get")["lease"]["state"] == "rejected"
        why = a.lease(lid, "why")
        assert why["ok"], why
        filters = why["result"]["reasons"]["filters"]
        assert filters["insufficient_gpu_memory"] == 2  # a node may fail several filters
        assert filters["insufficient_gpu"] == 1  # the CPU node has no GPU at all
        assert why["result"]["reasons"]["never_satisfiable"] is True


def test_a_busy_pool_says_why_a_request_waits(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=2000))
    admin.admin("node.register", node_body("n2", cpu_millis=2000))
    admin.admin("node/n2/cordon".replace("/", "."), {"reason": "disk"})
    with PoolClient(cp.nats_url, "alpha") as a:
        a.request_lease(lease_body("fill", cpu_millis=2000))
        cp.scheduler.cycle()
        lid = a.request_lease(lease_body("wait", cpu_millis=2000))["lease"]["lease_id"]
        cp.scheduler.cycle()
        reasons = a.lease(lid, "why")["result"]["reasons"]
    assert reasons["filters"] == {"node_cordoned": 1, "insufficient_cpu": 1}
    assert "waiting_for_capacity" in reasons["tenant"]
    assert reasons["never_satisfiable"] is False


def test_a_tenant_without_credit_for_the_hold_waits_with_insufficient_credits(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin, credits=1)
    # a price list makes the hold non-zero: 1 credit per core-second
    assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 1_000_000})["ok"]
    admin.admin("node.register", node_body("n1"))
    with PoolClient(cp.nats_url, "alpha") as a:
        lid = a.request_lease(lease_body("pricey"))["lease"]["lease_id"]
        cp.scheduler.cycle()
        why = a.lease(lid, "why")["result"]
    assert why["state"] == "queued"
    assert why["reasons"]["tenant"] == ["insufficient_credits"]


def test_a_tenant_over_its_quota_waits_with_quota_exceeded(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1", "weight": 1.0,
                                      "quota": {"cpu_millis": 1000}})["ok"]
    admin.admin("node.register", node_body("n1"))
    with PoolClient(cp.nats_url, "alpha") as a:
        a.request_lease(lease_body("q1"))
        second = a.request_lease(lease_body("q2"))["lease"]["lease_id"]
        cp.scheduler.cycle()
        assert a.lease(second, "why")["result"]["reasons"]["tenant"] == ["quota_exceeded"]


def test_concurrent_schedulers_never_double_place(plane: Plane) -> None:
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    for i in range(4):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=8192))
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        for i in range(30):
            a.request_lease(lease_body(f"a{i}"))
            b.request_lease(lease_body(f"b{i}"))
    rivals = [Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock) for _ in range(2)]
    barrier = threading.Barrier(len(rivals))

    def race(s: Scheduler) -> None:
        barrier.wait()
        for _ in range(6):
            s.cycle()

    threads = [threading.Thread(target=race, args=(s,)) for s in rivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(1 for _ in threads if _.is_alive()) == 0
    report = check_placements(cp.app)  # every node, every instant: leases fit, none held twice
    assert report.double_placements == 0, report.over_allocations + report.double_holds
    assert report.placements > 0
    reserved = sum(1 for agg in rivals[0].aggregates.values()
                   if type(agg).__name__ == "Lease" and agg.state.value == "reserved")  # type: ignore[attr-defined]
    rivals[0].cycle()
    assert reserved <= 16  # 4 nodes × 4 cores, 1 core each
    for s in rivals:
        s.app.close()


def _twelve_queued_in_small_batches(plane: Plane, monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    """4 nodes of 4 cores, 12 one-core requests queued, and batches of two placements: a fresh
    scheduler that will send several batches per cycle."""
    import control.scheduler.placing as sched

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
    import control.scheduler.placing as sched

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
    rivals = [Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock) for _ in range(2)]
    barrier = threading.Barrier(len(rivals))

    def race(s: Scheduler) -> None:
        barrier.wait()
        for _ in range(8):  # pipelined: each cycle's last batch in flight while the next reads
            s.cycle(settle=not pipelined)
        s.settle()

    threads = [threading.Thread(target=race, args=(s,)) for s in rivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
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
    from chaos.invariants import notifications

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


def test_fair_share_counts_the_ready_capacity_as_nodes_come_and_go(plane: Plane) -> None:
    """The DRF denominator is the allocatable capacity of the pool's ready nodes: a node that
    registers, is cordoned or returns changes the shares of the next cycle."""
    cp, admin, _clock = plane
    setup_pool(admin)
    for i in range(2):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=4000, memory_mib=4096))
    with PoolClient(cp.nats_url, "alpha") as a:
        assert a.request_lease(lease_body("one", cpu_millis=1000, memory_mib=512))["ok"]
        cp.scheduler.cycle()
        queue = cp.scheduler.pools["p1"].queue
        assert queue is not None
        first = queue.share("alpha")  # 1 of 8 cores, over alpha's weight
        assert first > 0
        admin.admin("node.n1.cordon", {"reason": "disk"})
        assert a.request_lease(lease_body("two", cpu_millis=1000, memory_mib=512))["ok"]
        cp.scheduler.cycle()
        queue = cp.scheduler.pools["p1"].queue
        assert queue is not None
        # 2 of 4 cores: n1 no longer counts
        assert queue.share("alpha") == pytest.approx(first * (2000 / 4000) / (1000 / 8000))
        admin.admin("node.register", node_body("n2", cpu_millis=12000, memory_mib=16384))
        assert a.request_lease(lease_body("three", cpu_millis=1000, memory_mib=512))["ok"]
        cp.scheduler.cycle()
        queue = cp.scheduler.pools["p1"].queue
        assert queue is not None
        assert queue.share("alpha") == pytest.approx(first * (3000 / 16000) / (1000 / 8000))


def test_a_catch_up_read_ahead_over_small_pages_and_own_batches_folds_what_a_fresh_one_does(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catch-up asks for the next page while it folds one; with pages of 3 events the reads
    ahead cross the ranges of the scheduler's own batches, which it steps over unread."""
    import control.scheduler.folding as sched_mod
    from chaos.invariants import notifications

    monkeypatch.setattr(sched_mod, "NOTIFICATION_PAGE", 3)
    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
    for i in range(3):
        admin.admin("node.register", node_body(f"n{i}", cpu_millis=8000, memory_mib=32768))
    s = Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        for round_ in range(3):
            for i in range(4):  # others write between our batches
                assert a.request_lease(lease_body(f"a{round_}-{i}", cpu_millis=500))["ok"]
                assert b.request_lease(lease_body(f"b{round_}-{i}", cpu_millis=500))["ok"]
            report = s.cycle()
            assert report.placed == 8 and report.conflicts == 0
        before = s.position
        for i in range(5):
            assert a.request_lease(lease_body(f"late{i}", cpu_millis=500))["ok"]
    log = list(notifications(s.app, before + 1))
    ours = sum(n.topic.endswith(("LeaseReserved", "CapacityAllocated",
                                 "CapacityAllocatedBatch", "CreditsHeld")) for n in log)
    assert s.catch_up() == len(log) - ours == 5  # only the others' events were read
    assert s.pages_read_ahead > 0 and s.pages_read_ahead_unused == 0
    # where the next read starts and ends around our own batches (events 10-15 and 20-22)
    s._own.extend([(10, 15), (20, 22)])
    assert [s._next_read(p) for p in (5, 6, 9, 16, 18, 19, 22)] == [
        (6, 3), (7, 3), (16, 3), (17, 3), (19, 1), (23, 3), (23, 3)]
    s._own.clear()
    assert s.position == log[-1].id
    fresh = Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
    fresh.catch_up()
    # read through read-ahead pages, every subject read is remembered with its end: a write
    # to any of these aggregates needs no look-up first
    from domain.lease import Lease

    rec = fresh.app.recorder
    leases = [a for a in fresh.aggregates.values() if isinstance(a, Lease)]
    assert len(leases) == 29 and fresh.pages_read_ahead > 0
    for lease in leases:
        state = rec._cache.get(rec.subject_for(lease.id))
        assert state is not None and state.last_version == lease.version
    assert {k: (type(v).__name__, v.version) for k, v in s.aggregates.items()} == {
        k: (type(v).__name__, v.version) for k, v in fresh.aggregates.items()}
    assert s.cycle().placed == 5
    for x in (s, fresh):
        x.close()
        x.app.close()


def test_a_cycle_places_what_a_short_page_held_and_the_next_follows_without_waiting(
        plane: Plane) -> None:
    """A read-ahead page may hold fewer events than the log has (what was stored when it was
    read). A cycle stops at such a page and places what it read, rather than reading on until
    a page comes back empty (under a steady stream of requests that chase never ended, and
    nothing was placed meanwhile); it says the log may hold more, and the run loop then goes
    straight to the next cycle instead of waiting for an append."""
    import concurrent.futures

    cp, admin, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0})
    admin.admin("node.register", node_body("n1", cpu_millis=64000, memory_mib=65536))
    s = Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
    s.catch_up()
    assert s._prefetch is not None
    real, pages = s._prefetch, []

    def two_at_a_time(start: int, limit: int, stop: int | None = None) -> Any:
        got: concurrent.futures.Future[Any] = concurrent.futures.Future()
        page = real(start, limit, stop).result()[:2]
        pages.append(len(page))
        got.set_result(page)
        return got

    s._prefetch = two_at_a_time
    with PoolClient(cp.nats_url, "alpha") as a:
        for i in range(5):
            assert a.request_lease(lease_body(f"r{i}"))["ok"]
        placed = []
        while True:
            pages.clear()
            report = s.cycle()
            placed.append(report.placed)
            assert sum(pages) <= 2  # what a short page held, no more
            if not s.maybe_behind:
                break
        assert placed == [2, 2, 1]
        # a cycle that placed nothing but stopped short is followed at once: with an idle
        # wait of a minute and no append signal, the request behind two other events (the
        # first cycle's whole page) is placed
        assert admin.admin("node.register", node_body("n2"))["ok"]
        assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                          "weight": 2.0})["ok"]
        late = a.request_lease(lease_body("late"))["lease"]["lease_id"]
        stop = threading.Event()
        runner = threading.Thread(target=s.run, args=(stop,), kwargs={"interval": 60.0})
        runner.start()
        try:
            for _ in range(100):
                if a.lease(late, "get")["lease"]["state"] == "reserved":
                    break
                stop.wait(0.1)
            assert a.lease(late, "get")["lease"]["state"] == "reserved"
        finally:
            stop.set()
            runner.join(10)
    s.close()
    s.app.close()


def test_a_cycle_holds_a_tenants_credits_in_one_event_and_never_past_its_balance(
    plane: Plane,
) -> None:
    """In a priced pool the holds of one tenant's placements in a batch are one
    CreditsHeldBatch on its account; each placement counts the holds before it, so a tenant
    whose credits cover two of three requests gets two placed and the third waits."""
    from chaos.invariants import notifications

    cp, admin, _clock = plane
    setup_pool(admin, credits=1300)
    # 1 micro-credit per core-second: a 1-core, 600 s lease holds 600
    assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 1})["ok"]
    admin.admin("node.register", node_body("n1"))
    with PoolClient(cp.nats_url, "alpha") as a:
        ids = [a.request_lease(lease_body(f"c{i}"))["lease"]["lease_id"] for i in range(3)]
        before = cp.scheduler.position
        assert cp.scheduler.cycle().placed == 2
        states = [a.lease(lid, "get")["lease"]["state"] for lid in ids]
        assert sorted(states) == ["queued", "reserved", "reserved"]
        waiting = ids[states.index("queued")]
        why = a.lease(waiting, "why")["result"]["reasons"]
        assert why["tenant"] == ["insufficient_credits"]
        assert (why["hold_microcredits"], why["available_microcredits"]) == (600, 100)
    held = [n for n in notifications(cp.scheduler.app, before + 1)
            if n.topic.endswith(("CreditsHeld", "CreditsHeldBatch"))]
    assert [n.topic.rpartition(".")[2] for n in held] == ["CreditsHeldBatch"]
    from domain.account import Account

    acc = cp.scheduler.app.repository.get(Account.create_id("alpha"))
    assert (acc.held, acc.available) == (1200, 100)
    assert {str(lid) for lid in acc.holds} == {lid for lid, s in zip(ids, states) if s == "reserved"}


def test_why_of_a_lease_no_cycle_has_examined_yet_says_so(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=1000, memory_mib=1024))
    with PoolClient(cp.nats_url, "alpha") as a:
        first = a.request_lease(lease_body("first"))["lease"]["lease_id"]
        cp.scheduler.cycle()  # the first is placed; the node is full
        waiting = a.request_lease(lease_body("waiting"))["lease"]["lease_id"]
        later = a.request_lease(lease_body("later"))["lease"]["lease_id"]
        cp.scheduler.catch_up()  # folded, not yet examined by a cycle
        unseen = cp.scheduler.why("alpha", later)
        assert unseen is not None and unseen["state"] == "queued"
        assert unseen["reasons"] == {"not_yet_examined": True}
        assert unseen["position"] is None
        cp.scheduler.cycle()
        seen = cp.scheduler.why("alpha", later)
        assert seen is not None and "not_yet_examined" not in seen["reasons"]
        assert seen["position"] == 2 and cp.scheduler.why("alpha", waiting)["position"] == 1
        assert cp.scheduler.why("alpha", first)["reasons"] == {}  # reserved: nothing to wait for
