"""The scheduler against a real log: fair share, reasons, credits, quotas, and no double placement."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from client.api import PoolClient
from projections.decisions import check_placements
from tests.control_plane import Plane, lease_body, node_body, race, rival_schedulers, setup_pool
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.plane import ControlPlane
from workers.scheduler import Scheduler


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
    rivals = rival_schedulers(cp, clock)

    def six_cycles(s: Scheduler) -> None:
        for _ in range(6):
            s.cycle()

    race(rivals, six_cycles)
    report = check_placements(cp.app)  # every node, every instant: leases fit, none held twice
    assert report.double_placements == 0, report.over_allocations + report.double_holds
    assert report.placements > 0
    reserved = sum(1 for agg in rivals[0].aggregates.values()
                   if type(agg).__name__ == "Lease" and agg.state.value == "reserved")  # type: ignore[attr-defined]
    rivals[0].cycle()
    assert reserved <= 16  # 4 nodes × 4 cores, 1 core each
    for s in rivals:
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
    import workers.scheduler.folding as sched_mod
    from projections.replay import notifications

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
    from projections.replay import notifications

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
