"""Gang placement: all-or-nothing, topology constraints always met, reasons for waiting and
for never fitting, and the bounded hold that guards a head gang against starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.policy.gang import Candidate, GangHolds, GangSpec, place_gang


def rack_nodes(racks: int, per_rack: int, busy: set[str] = frozenset()) -> list[Candidate]:  # type: ignore[assignment]
    return [Candidate(f"r{r}-n{i}", {"rack": f"rack-{r}", "failure_domain": f"fd-{i % 2}"},
                      fits_now=f"r{r}-n{i}" not in busy)
            for r in range(racks) for i in range(per_rack)]


def test_a_gang_that_packs_takes_the_fullest_rack_that_holds_it_whole() -> None:
    busy = {"r0-n0", "r0-n1", "r0-n2"}  # rack-0 has 1 free, rack-1 and rack-2 have 4
    busy |= {"r2-n0"}  # rack-2 has 3 free
    d = place_gang(GangSpec.build(3, same="rack"), rack_nodes(3, 4, busy))
    assert d.placed and {n.split("-")[0] for n in d.nodes} == {"r2"}


def test_a_strict_gang_that_must_wait_says_which_domain_holds_how_many() -> None:
    busy = {"r0-n0", "r1-n0", "r1-n1"}
    d = place_gang(GangSpec.build(4, same="rack"), rack_nodes(2, 4, busy))
    assert not d.placed and not d.never_fits
    assert d.reason == "gang_incomplete: best rack rack-0 holds 3 of 4"
    assert d.best_domain == "rack-0" and len(d.best_nodes) == 3


def test_a_gang_larger_than_any_rack_is_rejected_at_once_with_filter_counts() -> None:
    nodes = rack_nodes(2, 4) + [Candidate("cpu", {"rack": "rack-0"}, eligible=False,
                                          failures=("insufficient_gpu",))]
    d = place_gang(GangSpec.build(5, same="rack"), nodes)
    assert d.never_fits and d.reason is not None and d.reason.startswith("gang_never_fits")
    assert d.filters == {"insufficient_gpu": 1}
    # without the rack constraint it fits across racks
    assert place_gang(GangSpec.build(5), nodes).placed


def test_strict_spread_puts_each_member_in_its_own_failure_domain() -> None:
    d = place_gang(GangSpec.build(2, spread="failure_domain"), rack_nodes(1, 4))
    assert d.placed and len({int(n[-1]) % 2 for n in d.nodes}) == 2
    never = place_gang(GangSpec.build(3, spread="failure_domain"), rack_nodes(1, 4))
    assert never.never_fits


def test_held_nodes_are_not_given_to_another_gang() -> None:
    nodes = rack_nodes(1, 4)
    d = place_gang(GangSpec.build(2, same="rack"), nodes, blocked={"r0-n0", "r0-n1", "r0-n2"})
    assert not d.placed and d.reason == "gang_incomplete: best rack rack-0 holds 1 of 2"


def test_a_hold_is_bounded_then_cools_down() -> None:
    holds = GangHolds(max_hold_seconds=10)
    assert holds.hold("g", {"a", "b"}, now=0)
    assert holds.blocked(5) == {"a", "b"} and holds.blocked(5, except_for="g") == set()
    assert holds.blocked(10) == set() and holds.expired == 1
    assert not holds.hold("g", {"a"}, now=15)  # cooling down until 20
    assert holds.hold("g", {"a"}, now=20)
    holds.release("g")
    assert holds.blocked(21) == set()


def test_conflicting_constraints_are_refused() -> None:
    with pytest.raises(ValueError):
        GangSpec.build(2, same="rack", spread="failure_domain")
    with pytest.raises(ValueError):
        GangSpec(members=2, strategy="SPREAD", same="rack")
    with pytest.raises(ValueError):
        GangSpec.build(2, same="hostname")


LABELS = st.fixed_dictionaries({"rack": st.sampled_from(["a", "b", "c"]),
                                "failure_domain": st.sampled_from(["x", "y"])})
NODES = st.lists(st.tuples(LABELS, st.booleans(), st.booleans()), max_size=14)


@settings(max_examples=300, deadline=None)
@given(NODES, st.integers(1, 6), st.sampled_from(["PACK", "SPREAD", "STRICT_PACK",
                                                   "STRICT_SPREAD"]),
       st.sets(st.integers(0, 13), max_size=4))
def test_a_placed_gang_meets_its_constraints_on_distinct_free_unheld_nodes(
        nodes: list[tuple[dict[str, str], bool, bool]], n: int, strategy: str,
        blocked_idx: set[int]) -> None:
    cands = [Candidate(f"n{i}", labels, eligible=el, fits_now=el and fits)
             for i, (labels, el, fits) in enumerate(nodes)]
    blocked = {f"n{i}" for i in blocked_idx}
    spec = GangSpec.build(n, strategy=strategy)
    d = place_gang(spec, cands, blocked)
    by_id = {c.node_id: c for c in cands}
    if d.placed:
        assert len(d.nodes) == n == len(set(d.nodes))  # all members, one node each
        assert all(by_id[x].fits_now and x not in blocked for x in d.nodes)
        values = [by_id[x].value(spec.key) for x in d.nodes]
        if strategy == "STRICT_PACK":
            assert len(set(values)) == 1
        if strategy == "STRICT_SPREAD":
            assert len(set(values)) == n
    else:
        assert d.reason is not None and d.nodes == ()
        free = [c for c in cands if c.fits_now and c.node_id not in blocked]
        groups: dict[str, int] = {}
        for c in free:
            groups[c.value(spec.key)] = groups.get(c.value(spec.key), 0) + 1
        # nothing was missed: the constraint really cannot be met with the free nodes
        if strategy == "STRICT_PACK":
            assert max(groups.values(), default=0) < n
        elif strategy == "STRICT_SPREAD":
            assert len(groups) < n
        else:
            assert len(free) < n
