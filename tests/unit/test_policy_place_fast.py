"""place_fast remembers per-shape node keys between calls; it must choose exactly as place."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from domain.errors import CapacityError
from domain.policy.placement import NodeTable
from domain.resources import NodeCapabilities, Resources, Shape

SHAPES = [
    Shape.build(cpu_millis=1000, memory_mib=1024),
    Shape.build(cpu_millis=4000, memory_mib=512),
    Shape.build(cpu_millis=500, memory_mib=8192, gpu_count=1),
    Shape.build(cpu_millis=2000, memory_mib=2048, zone="z1"),
    Shape.build(cpu_millis=6000, memory_mib=9000, gpu_count=1),  # fits few nodes, often none
    Shape.build(cpu_millis=500, gpu_partition="1g.10gb"),  # a dimension no node offers
]


def _table(n: int) -> NodeTable:
    t = NodeTable()
    for i in range(n):
        caps = NodeCapabilities(
            allocatable=Resources(cpu_millis=2000 * (1 + i % 4), memory_mib=4096 * (1 + i % 3),
                                  gpu_count=i % 2),
            zone=f"z{i % 2}", failure_domain=f"fd{i % 3}",
        )
        t.add_or_update_node(f"n{i}", caps)
    return t


ops = st.lists(
    st.tuples(st.sampled_from(["place", "free", "cordon", "uncordon"]),
              st.integers(0, len(SHAPES) - 1), st.integers(0, 40)),
    min_size=1, max_size=60,
)


# mostly placements, no state changes (which forget the memory): misses recounted many times
filling = st.lists(
    st.tuples(st.sampled_from(["place", "place", "place", "free"]),
              st.integers(0, len(SHAPES) - 1), st.integers(0, 40)),
    min_size=1, max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), ops)
def test_place_fast_chooses_the_same_node_as_place_after_any_history(n: int, history: list[tuple[str, int, int]]) -> None:
    _replay(n, history)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), filling)
def test_a_shape_that_fits_nowhere_is_told_what_a_fresh_filter_says(
        n: int, history: list[tuple[str, int, int]]) -> None:
    _replay(n, history)


def _replay(n: int, history: list[tuple[str, int, int]]) -> None:
    fast, slow = _table(n), _table(n)
    placed: list[str] = []
    for step, (op, shape_i, k) in enumerate(history):
        shape = SHAPES[shape_i]
        if op == "place":
            a, got = fast.place_fast(shape)
            b, _ = slow.place(shape)
            assert a == b, (step, op)
            if a is None:  # a miss is told exactly what a fresh filter says, order included
                want = slow.filter(shape)
                assert list(got.failures.items()) == list(want.failures.items()), step
                assert got.eligible.tolist() == want.eligible.tolist() == []
                assert got.busy.tolist() == want.busy.tolist()
                assert (got.nodes_total, got.never_satisfiable, got.fit_when_empty) == (
                    want.nodes_total, want.never_satisfiable, want.fit_when_empty)
            if a is not None:
                lid = f"l{step}"
                fast.allocate(a, lid, shape.resources)
                slow.allocate(b, lid, shape.resources)
                placed.append(lid)
        elif op == "free" and placed:
            lid = placed.pop(k % len(placed))
            fast.free(lid)
            slow.free(lid)
        elif op in ("cordon", "uncordon"):
            node = f"n{k % n}"
            state = "cordoned" if op == "cordon" else "ready"
            fast.set_state(node, state)
            slow.set_state(node, state)


PREFERRING = [
    Shape.build(cpu_millis=1000, memory_mib=1024, preferences=[("zone", "z1")]),
    Shape.build(cpu_millis=500, memory_mib=2048,
                preferences=[("node_label", "disk=ssd"), ("zone", "z0"), ("region", "r9")]),
    Shape.build(cpu_millis=500, gpu_partition="1g.10gb"),
    Shape.build(),
]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10), st.lists(st.tuples(st.integers(0, 7), st.integers(0, 9)), max_size=40))
def test_a_single_row_is_scored_exactly_as_the_vectorised_ranking_scores_it(
    n: int, allocations: list[tuple[int, int]]
) -> None:
    t = NodeTable()
    for i in range(n):
        ext = (("gpu/1g.10gb", 1 + i % 3),) if i % 2 else ()
        caps = NodeCapabilities(
            allocatable=Resources(cpu_millis=2000 * (1 + i % 4), memory_mib=4096 * (1 + i % 3),
                                  gpu_count=i % 2, extended=ext),
            zone=f"z{i % 2}", failure_domain=f"fd{i % 3}",
            labels=(("disk", "ssd"),) if i % 3 == 0 else (),
        )
        t.add_or_update_node(f"n{i}", caps)
    for step, (shape_i, node_i) in enumerate(allocations):
        shape = (SHAPES + PREFERRING)[shape_i]
        node = f"n{node_i % n}"
        try:
            t.allocate(node, f"l{step}", shape.resources)
        except CapacityError:
            pass  # does not fit there: the table stays as it was
        for s in SHAPES + PREFERRING:
            eligible = t.filter(s).eligible
            if not eligible.size:
                continue
            keys = t._rank_keys(s, eligible, "best-fit", None)
            for row, key in zip(eligible.tolist(), keys.tolist(), strict=True):
                assert t._row_key(s, row) == key


def test_the_table_remembers_a_bounded_number_of_shapes(monkeypatch: Any) -> None:
    """Past `MEMO_SHAPES` shapes the oldest memory goes, and what the table says stays exact."""
    from domain.policy.placement import fast

    monkeypatch.setattr(fast, "MEMO_SHAPES", 4)
    table, fresh = _table(8), _table(8)
    shapes = [Shape.build(cpu_millis=100 * (k + 1), memory_mib=64) for k in range(10)]
    shapes.append(Shape.build(cpu_millis=99_000, memory_mib=64))  # fits nowhere
    for shape in shapes * 2:
        node, result = table.place_fast(shape)
        assert node == fresh.place(shape)[0] and result.failures == fresh.filter(shape).failures
        assert len(table._memo) <= 4
