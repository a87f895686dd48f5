"""Advance reservations and maintenance windows: the aggregate, the capacity it withholds, and
backfill keeping other leases out of it."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.errors import InvalidReservation, ReservationDeleted
from domain.policy.backfill import Backfill, LeaseEnd
from domain.policy.placement import NodeTable
from domain.reservation import CapacityReservation, NodeSpace, Window, withhold
from domain.resources import NodeCapabilities, PoolId, Resources, Shape


def gpus(n: int) -> Resources:
    return Resources(gpu_count=n)


def reserve(**kw: object) -> CapacityReservation:
    fields: dict[str, object] = {
        "reservation_id": "r1", "pool_id": PoolId("p"), "tenant_id": "acme",
        "resources": gpus(2), "count": 1, "node_ids": (), "start_at": 100.0,
        "duration_seconds": 50.0, "now": 0.0}
    fields.update(kw)
    return CapacityReservation.create(**fields)  # type: ignore[arg-type]


def window(rid: str = "r1", *, tenant: str | None = "acme", n: int = 2, count: int = 1,
           nodes: tuple[str, ...] = (), start: float = 100.0, end: float = 150.0) -> Window:
    return Window(rid, "p", tenant, gpus(n) if tenant else Resources(), count, nodes,
                  start, end)


def space(node_id: str, total: int, free_at: float | None = None) -> NodeSpace:
    free = total if free_at is None else free_at
    return NodeSpace(node_id, lambda: gpus(total), lambda _at: gpus(int(free)))


# -- the aggregate ------------------------------------------------------------------------------


def test_a_tenants_reservation_is_recorded_with_its_window() -> None:
    r = reserve()
    assert r.window == window()
    assert [type(e).__name__ for e in r.collect_events()] == ["ReservationCreated"]


def test_a_reservation_folds_back_from_its_events() -> None:
    r = reserve()
    r.delete(120.0)
    events = r.collect_events()
    again = None
    for e in events:
        again = e.mutate(again)
    assert isinstance(again, CapacityReservation)
    assert again.window == r.window and again.deleted_at == 120.0
    assert again.status_at(130.0) == "deleted"


@pytest.mark.parametrize(("fields", "reason"), [
    ({"resources": Resources()}, "non-zero shape"),
    ({"duration_seconds": 0}, "duration_seconds"),
    ({"start_at": 0.0, "duration_seconds": 5.0, "now": 10.0}, "ended already"),
    ({"tenant_id": None, "resources": Resources()}, "names the nodes"),
    ({"node_ids": ("n1",)}, "not nodes"),
    ({"count": 0}, "count"),
    ({"tenant_id": None, "resources": Resources(), "node_ids": ("n1", "n1")}, "twice"),
])
def test_a_reservation_that_makes_no_sense_is_refused_with_its_reason(
        fields: dict[str, object], reason: str) -> None:
    with pytest.raises(InvalidReservation) as e:
        reserve(**fields)
    assert e.value.code == "invalid_reservation"
    assert any(reason in r for r in e.value.reasons)


def test_a_reservation_is_deleted_once() -> None:
    r = reserve()
    r.delete(10.0)
    with pytest.raises(ReservationDeleted):
        r.delete(11.0)


def test_status_follows_the_window() -> None:
    r = reserve()
    assert [r.status_at(t) for t in (99.0, 100.0, 149.9, 150.0)] == [
        "upcoming", "active", "active", "ended"]


# -- what is withheld ---------------------------------------------------------------------------


def test_a_maintenance_window_withholds_its_nodes_whole() -> None:
    out, short = withhold([window(tenant=None, nodes=("a",))], 0.0,
                          [space("a", 8, free_at=2), space("b", 8)], {})
    assert [(w.node_id, w.resources, w.start_at) for w in out] == [("a", gpus(8), 100.0)]
    assert short == {}


def test_units_go_where_capacity_is_free_at_the_windows_start() -> None:
    out, _ = withhold([window(n=4, count=2)], 0.0,
                      [space("a", 8, free_at=0), space("b", 8, free_at=8)], {})
    assert [(w.node_id, w.resources) for w in out] == [("b", gpus(8))]


def test_units_its_leases_already_use_are_not_withheld_again() -> None:
    out, _ = withhold([window(n=4, count=2)], 120.0, [space("a", 8)], {"r1": 1})
    assert [(w.node_id, w.resources, w.start_at) for w in out] == [("a", gpus(4), 120.0)]


def test_an_ended_or_oversized_window_withholds_nothing_or_reports_the_shortfall() -> None:
    assert withhold([window()], 150.0, [space("a", 8)], {}) == ([], {})
    out, short = withhold([window(n=4, count=3)], 0.0, [space("a", 8)], {})
    assert sum(w.resources.gpu_count for w in out) == 8 and short == {"r1": 1}


def test_a_later_window_does_not_take_what_an_earlier_one_holds() -> None:
    out, short = withhold([window("late", n=8, start=200.0, end=300.0), window("early", n=8)],
                          0.0, [space("a", 8), space("b", 8)], {})
    assert {(w.reservation_id, w.node_id) for w in out} == {("early", "a"), ("late", "b")}
    assert short == {}


@settings(max_examples=200, deadline=None)
@given(totals=st.lists(st.integers(0, 16), min_size=1, max_size=6),
       asks=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 6), st.integers(0, 3)),
                     min_size=1, max_size=5))
def test_withheld_units_never_pass_a_nodes_capacity_and_all_are_accounted(
        totals: list[int], asks: list[tuple[int, int, int]]) -> None:
    nodes = [space(f"n{i}", t) for i, t in enumerate(totals)]
    wins = [window(f"r{i}", n=n, count=c, start=float(i)) for i, (n, c, _u) in enumerate(asks)]
    used = {f"r{i}": u for i, (_n, _c, u) in enumerate(asks)}
    out, short = withhold(wins, 0.0, nodes, used)
    for i, t in enumerate(totals):
        assert sum(w.resources.gpu_count for w in out if w.node_id == f"n{i}") <= t
    for i, (n, c, u) in enumerate(asks):
        kept = sum(w.resources.gpu_count for w in out if w.reservation_id == f"r{i}")
        assert kept + short.get(f"r{i}", 0) * n == max(0, c - u) * n


# -- backfill keeps others out ------------------------------------------------------------------


def backfill_with(withheld_from: list[Window], now: float, running: dict[str, tuple[int, float]]
                  ) -> Backfill:
    table = NodeTable()
    table.add_or_update_node("a", NodeCapabilities(allocatable=gpus(8)))
    ends: dict[str, LeaseEnd] = {}
    for lid, (n, end) in running.items():
        table.allocate("a", lid, gpus(n))
        ends[lid] = (gpus(n), end)
    bf = Backfill(table, ends.get)
    bf.begin(now, queued=lambda _lid: True)
    nodes = [NodeSpace("a", lambda: gpus(8), lambda at: bf.capacity_at("a", at))]
    bf.withhold(withhold(withheld_from, now, nodes, {})[0])
    return bf


def test_another_lease_that_would_run_into_the_window_is_kept_out() -> None:
    bf = backfill_with([window(n=8)], 0.0, {})
    assert not bf.admits("a", gpus(1), end_at=101.0)
    assert bf.admits("a", gpus(8), end_at=100.0)  # ends before the window begins


def test_during_the_window_only_the_tenants_own_lease_gets_in() -> None:
    bf = backfill_with([window(n=6)], 110.0, {})
    assert bf.admits("a", gpus(2), end_at=None)  # beside it
    assert not bf.admits("a", gpus(3), end_at=None)
    assert bf.admits("a", gpus(6), end_at=None, window="r1")


def test_a_maintenance_window_admits_nothing_that_would_not_end_before_it() -> None:
    bf = backfill_with([window(tenant=None, nodes=("a",))], 0.0, {})
    assert not bf.admits("a", gpus(1), end_at=100.5)
    assert bf.admits("a", gpus(1), end_at=99.0)


def test_after_the_window_capacity_returns() -> None:
    bf = backfill_with([window(n=8)], 150.0, {})
    assert bf.admits("a", gpus(8), end_at=None)


def test_a_blocked_head_is_not_reserved_capacity_a_window_keeps() -> None:
    bf = backfill_with([window(n=6, start=0.0, end=500.0)], 10.0, {"x": (2, 100.0)})
    r = bf.blocked("head", Shape.build(gpu_count=4), band=0)
    assert r is not None and r.start_at == 500.0  # 6 free at 100, but kept until 500


def test_a_maintenance_window_is_drained_once_and_a_reservation_never() -> None:
    m = reserve(tenant_id=None, resources=Resources(), node_ids=("a",))
    assert reserve().drain_due_at(30) is None
    assert m.drain_due_at(30) == 70.0
    assert m.must_leave(100.5) and not m.must_leave(100.0) and m.must_leave(None)
    m.begin_drain(70.0)
    assert m.drain_due_at(30) is None
    with pytest.raises(InvalidReservation):
        m.begin_drain(71.0)
    with pytest.raises(InvalidReservation):
        reserve().begin_drain(70.0)


@settings(max_examples=150, deadline=None)
@given(nodes=st.integers(1, 3),
       wins=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(0, 300),
                               st.integers(1, 300)), min_size=1, max_size=4),
       asks=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 600)), max_size=12))
def test_no_placement_of_others_leaves_a_window_short_at_its_start(
        nodes: int, wins: list[tuple[int, int, int, int]], asks: list[tuple[int, int]]) -> None:
    table = NodeTable()
    for i in range(nodes):
        table.add_or_update_node(f"n{i}", NodeCapabilities(allocatable=gpus(8)))
    ends: dict[str, LeaseEnd] = {}
    bf = Backfill(table, ends.get)
    bf.begin(0.0, queued=lambda _lid: True)
    spaces = [NodeSpace(f"n{i}", lambda: gpus(8), functools.partial(bf.capacity_at, f"n{i}"))
              for i in range(nodes)]
    windows = [window(f"r{i}", n=n, count=c, start=float(s), end=float(s + d))
               for i, (n, c, s, d) in enumerate(wins)]
    kept = withhold(windows, 0.0, spaces, {})[0]
    bf.withhold(kept)
    for j, (n, end) in enumerate(asks):
        node, _fr, _held = bf.place(Shape.build(gpu_count=n), float(end), packing="best-fit",
                                    allowed_trust_levels=None)
        if node is not None:
            table.allocate(node, f"l{j}", gpus(n))
            ends[f"l{j}"] = (gpus(n), float(end))
    for w in kept:
        overlapping = [o for o in kept if o.node_id == w.node_id
                       and o.start_at <= w.start_at < o.end_at]
        left = bf.capacity_at(w.node_id, w.start_at)
        for o in overlapping:
            left = left - o.resources
        assert left.is_non_negative(), (w, overlapping)
