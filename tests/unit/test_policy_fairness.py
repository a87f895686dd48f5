"""Weighted DRF, priority classes with aging, FairQueue, decayed usage, and quotas.

The DRF case is the worked example of Ghodsi et al., NSDI 2011 (section 4).
"""

from __future__ import annotations

import math

import pytest

from domain.policy import (
    FairQueue,
    NodeTable,
    PendingRequest,
    dominant_share,
    effective_rank,
    order_pending,
    quota_check,
    weighted_dominant_share,
)
from domain.policy.fairness import DecayedUsage
from domain.resources import NodeCapabilities, Resources, Shape

GIB = 1024
RANKS = {"low": 0, "normal": 1, "high": 2}


def req(lease: str, tenant: str, shape: Shape, seq: int, cls: str = "normal",
        at: float = 0.0) -> PendingRequest:
    return PendingRequest(lease, tenant, cls, shape, at, seq)


def run_drf(table: NodeTable, queue: FairQueue, now: float = 0.0) -> dict[str, int]:
    """Progressive filling: pop in fair order, place where it fits, skip what does not."""
    placed: dict[str, int] = {}
    while (r := queue.pop(now)) is not None:
        node, _ = table.place(r.shape)
        if node is None:
            continue
        table.allocate(node, r.lease_id, r.shape.resources, tenant=r.tenant)
        queue.placed(r)
        placed[r.tenant] = placed.get(r.tenant, 0) + 1
    return placed


def test_dominant_share_is_the_largest_fraction_of_any_resource() -> None:
    totals = Resources(cpu_millis=9000, memory_mib=18 * GIB)
    assert dominant_share(Resources(cpu_millis=1000, memory_mib=4 * GIB), totals) == 4 / 18
    assert dominant_share(Resources(cpu_millis=3000, memory_mib=1 * GIB), totals) == 3 / 9
    assert dominant_share(Resources(gpu_count=1), totals) == 0.0  # pool has no GPUs
    assert weighted_dominant_share(Resources(cpu_millis=3000), totals, 2.0) == pytest.approx(1 / 6)
    assert weighted_dominant_share(Resources(cpu_millis=3000), totals, 0.0) == math.inf


def test_drf_matches_the_papers_worked_example() -> None:
    table = NodeTable()
    table.add_or_update_node("n", NodeCapabilities(Resources(cpu_millis=9000,
                                                             memory_mib=18 * GIB)))
    a = Shape.build(cpu_millis=1000, memory_mib=4 * GIB)
    b = Shape.build(cpu_millis=3000, memory_mib=1 * GIB)
    queue = FairQueue(table.totals())
    seq = 0
    for i in range(10):
        for tenant, shape in (("A", a), ("B", b)):
            queue.push(req(f"{tenant}{i}", tenant, shape, seq))
            seq += 1
    placed = run_drf(table, queue)
    assert placed == {"A": 3, "B": 2}
    # Both end with the same dominant share, 2/3 (A of memory, B of CPU).
    assert queue.share("A") == pytest.approx(2 / 3) and queue.share("B") == pytest.approx(2 / 3)


def test_weights_shift_the_drf_outcome_proportionally() -> None:
    table = NodeTable()
    table.add_or_update_node("n", NodeCapabilities(Resources(cpu_millis=12_000,
                                                             memory_mib=12 * GIB)))
    task = Shape.build(cpu_millis=1000, memory_mib=1 * GIB)
    queue = FairQueue(table.totals(), weights={"A": 2.0, "B": 1.0})
    for i in range(20):
        queue.push(req(f"a{i}", "A", task, 2 * i))
        queue.push(req(f"b{i}", "B", task, 2 * i + 1))
    assert run_drf(table, queue) == {"A": 8, "B": 4}


def test_order_pending_puts_the_lower_weighted_share_first_then_fifo() -> None:
    totals = Resources(cpu_millis=10_000)
    shape = Shape.build(cpu_millis=1000)
    pending = [req("h1", "heavy", shape, 0), req("l1", "light", shape, 1),
               req("l2", "light", shape, 2)]
    usage = {"heavy": Resources(cpu_millis=5000), "light": Resources(cpu_millis=1000)}
    order = order_pending(pending, usage, {}, totals, RANKS, 0, now=0)
    assert [p.lease_id for p in order] == ["l1", "l2", "h1"]
    # With weight 10 heavy's weighted share (0.05) drops below light's (0.1).
    order = order_pending(pending, usage, {"heavy": 10}, totals, RANKS, 0, now=0)
    assert [p.lease_id for p in order] == ["h1", "l1", "l2"]


def test_priority_class_beats_share() -> None:
    totals = Resources(cpu_millis=10_000)
    shape = Shape.build(cpu_millis=1000)
    usage = {"rich": Resources(cpu_millis=9000)}
    pending = [req("poor", "poor", shape, 0, "normal"), req("rich", "rich", shape, 1, "high")]
    order = order_pending(pending, usage, {}, totals, RANKS, 0, now=0)
    assert [p.lease_id for p in order] == ["rich", "poor"]
    queue = FairQueue(totals, priority_ranks=RANKS, usage_by_tenant=usage)
    queue.extend(pending)
    assert [p.lease_id for p in queue.drain(now=0)] == ["rich", "poor"]


def test_effective_rank_ages_one_class_per_period_and_stops_at_the_top() -> None:
    assert effective_rank(0, 2, 59, 60) == 0
    assert effective_rank(0, 2, 60, 60) == 1
    assert effective_rank(0, 2, 10_000, 60) == 2
    assert effective_rank(0, 2, 10_000, 0) == 0  # aging disabled


def test_aging_lets_a_light_tenants_old_request_run_under_a_flood() -> None:
    table = NodeTable()
    table.add_or_update_node("n", NodeCapabilities(Resources(cpu_millis=4000)))
    task = Shape.build(cpu_millis=1000)
    queue = FairQueue(table.totals(), weights={"flood": 10.0, "light": 0.5},
                      priority_ranks=RANKS, aging_seconds_per_rank=100)
    queue.push(req("light-0", "light", task, 0, "low", at=0.0))
    seq = 1
    ran_light_at: float | None = None
    for tick in range(50):  # every 10 s: one flood lease finishes, two more arrive at "high"
        now = tick * 10.0
        for _ in range(2):
            queue.push(req(f"f{seq}", "flood", task, seq, "high", at=now))
            seq += 1
        if tick > 0 and table.free(f"run{tick - 1}"):  # every earlier run was the flood's
            queue.released("flood", task.resources)
        r = queue.pop(now)
        assert r is not None
        node, _ = table.place(task)
        if node is None:
            queue.requeue(r)
            continue
        table.allocate(node, f"run{tick}", task.resources)
        queue.placed(r)
        if r.tenant == "light":
            ran_light_at = now
            break
    # Low class ages to high after 2 × 100 s, and there its share (0) beats the flood's.
    assert ran_light_at is not None and 200 <= ran_light_at < 300


def test_without_aging_the_flood_starves_the_low_class() -> None:
    totals = Resources(cpu_millis=4000)
    task = Shape.build(cpu_millis=1000)
    pending = [req("light", "light", task, 0, "low", at=0)] + [
        req(f"f{i}", "flood", task, i + 1, "high", at=float(i)) for i in range(5)
    ]
    order = order_pending(pending, {}, {}, totals, RANKS, 0, now=10_000)
    assert order[-1].lease_id == "light"
    aged = order_pending(pending, {"flood": Resources(cpu_millis=3000)}, {}, totals, RANKS,
                         100, now=10_000)
    assert aged[0].lease_id == "light"


def test_fair_queue_requeue_keeps_place_and_remove_cancels() -> None:
    queue = FairQueue(Resources(cpu_millis=10), priority_ranks=RANKS)
    shape = Shape.build(cpu_millis=1)
    queue.extend([req("a", "t", shape, 0), req("b", "t", shape, 1), req("c", "u", shape, 2)])
    first = queue.pop(0)
    assert first is not None and first.lease_id == "a"
    queue.requeue(first)
    assert queue.remove("b") is not None and "b" not in queue
    assert [p.lease_id for p in queue.drain(0)] == ["a", "c"]
    assert queue.pop(0) is None and len(queue) == 0


def test_fair_queue_and_order_pending_agree_while_usage_is_unchanged() -> None:
    totals = Resources(cpu_millis=10_000, memory_mib=10_000)
    usage = {"a": Resources(cpu_millis=2000), "b": Resources(memory_mib=500),
             "c": Resources(cpu_millis=100, memory_mib=3000)}
    shape = Shape.build(cpu_millis=1)
    pending = [
        req(f"r{i}", "abc"[i % 3], shape, i, ["low", "normal", "high"][(i * 7) % 3], at=i * 13.0)
        for i in range(30)
    ]
    weights = {"a": 2.0, "b": 0.5}
    expected = order_pending(pending, usage, weights, totals, RANKS, 120, now=400)
    queue = FairQueue(totals, weights, RANKS, 120, usage)
    queue.extend(reversed(pending))
    assert [p.lease_id for p in queue.drain(400)] == [p.lease_id for p in expected]


def test_quota_check_lists_exceeded_dimensions() -> None:
    usage = Resources(cpu_millis=3000, gpu_count=1)
    request = Resources(cpu_millis=2000, gpu_count=1)
    assert quota_check(usage, request, None) == []
    assert quota_check(usage, request, Resources(cpu_millis=4000, gpu_count=2,
                                                memory_mib=1)) == ["cpu_millis"]
    assert quota_check(usage, request, {"gpu_count": 1}) == ["gpu_count"]
    assert quota_check(usage, request, {"cpu_millis": 5000}) == []


def test_the_scalar_pick_of_the_next_slot_agrees_with_the_vectorised_one() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    step = st.tuples(st.sampled_from(["push", "pop", "use", "free"]), st.integers(0, 5),
                     st.sampled_from(["low", "normal", "high"]), st.integers(0, 600))

    @settings(max_examples=150, deadline=None)
    @given(st.sampled_from([0.0, 60.0, 120.0]), st.lists(step, min_size=1, max_size=60))
    def check(aging: float, steps: list[tuple[str, int, str, int]]) -> None:
        queue = FairQueue(Resources(cpu_millis=10_000, memory_mib=10_000),
                          {"t1": 2.0, "t3": 0.5}, RANKS, aging)
        shape = Shape.build(cpu_millis=100, memory_mib=50)
        for i, (op, tenant_i, cls, at) in enumerate(steps):
            tenant = f"t{tenant_i}"
            if op == "push":
                queue.push(req(f"r{i}", tenant, shape, i, cls, at=float(at)))
            elif op == "pop":
                queue.pop(float(at) + 300)
            elif op == "use":
                queue.add_usage(tenant, Resources(cpu_millis=at, memory_mib=at // 2))
            else:
                queue.set_usage(tenant, Resources())
            for now in (0.0, float(at), float(at) + 500):
                assert queue._best_slot(now) == queue._best_slot_vectorised(now)

    check()


# -- decayed usage (fair share that remembers) ---------------------------------------------------


def test_decayed_usage_integrates_exactly_and_halves_each_half_life() -> None:
    hour = 3600.0
    decay = DecayedUsage(half_life_seconds=hour)
    decay.set_usage("t", 0.0, Resources(cpu_millis=1000))
    decay.set_usage("t", hour, Resources())  # held 1000 for one half-life, then nothing
    tau = hour / math.log(2)
    held = decay.usage("t", hour)["cpu_millis"]
    assert held == pytest.approx(1000 * tau * 0.5)
    assert decay.usage("t", 2 * hour)["cpu_millis"] == pytest.approx(held / 2)
    # the share is against the pool held for ever: all of a 1000-milli pool for ever → 1.0
    forever = DecayedUsage(half_life_seconds=hour)
    forever.set_usage("t", 0.0, Resources(cpu_millis=1000))
    assert forever.share("t", 1e9, Resources(cpu_millis=1000)) == pytest.approx(1.0)
    assert DecayedUsage(0).share("t", 10.0, Resources(cpu_millis=1)) == 0.0


def test_a_tenant_that_used_nothing_goes_ahead_of_one_that_used_the_fleet_all_night() -> None:
    totals = Resources(cpu_millis=8000)
    decay = DecayedUsage(half_life_seconds=4 * 3600)
    decay.set_usage("night", 0.0, totals)  # the whole fleet from midnight ...
    decay.set_usage("night", 8 * 3600.0, Resources())  # ... until eight
    now = 9 * 3600.0
    q = FairQueue(totals)
    # night asked first, with the same class and no current usage: FIFO would pick it
    q.push(PendingRequest("n1", "night", "default", Shape.build(cpu_millis=1000), now - 60, 1))
    q.push(PendingRequest("f1", "fresh", "default", Shape.build(cpu_millis=1000), now - 30, 2))
    assert q.peek(now) is not None and q.peek(now).tenant == "night"  # type: ignore[union-attr]
    for tenant in decay.tenants() + ["fresh"]:
        q.set_history(tenant, decay.share(tenant, now, totals))
    assert [r.tenant for r in q.drain(now)] == ["fresh", "night"]


def test_decayed_usage_fades_so_the_heavy_tenant_is_even_again_later() -> None:
    totals = Resources(cpu_millis=8000)
    decay = DecayedUsage(half_life_seconds=3600)
    decay.set_usage("heavy", 0.0, totals)
    decay.set_usage("heavy", 3600.0, Resources())
    early, late = decay.share("heavy", 3600.0, totals), decay.share("heavy", 20 * 3600.0, totals)
    assert late < early / 100_000
