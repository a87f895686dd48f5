"""NodeTable: one test per filter reason, satisfiability, packing, preferences, and invariants.

Pure policy tests: no servers, no clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.policy import CapacityError, NodeTable
from domain.policy import reasons as R
from domain.resources import NodeCapabilities, Resources, Shape


def caps(**kw: Any) -> NodeCapabilities:
    res = {"cpu_millis": 8000, "memory_mib": 16384, "gpu_count": 0, "local_disk_gib": 100}
    for k in list(res):
        if k in kw:
            res[k] = kw.pop(k)
    ext = kw.pop("extended", ())
    return NodeCapabilities(allocatable=Resources(**res, extended=ext), **kw)


def table_of(*nodes: tuple[str, NodeCapabilities] | tuple[str, NodeCapabilities, str]) -> NodeTable:
    t = NodeTable(initial_capacity=2)  # small on purpose: exercises growth
    for entry in nodes:
        t.add_or_update_node(*entry)
    return t


SMALL = Shape.build(cpu_millis=1000, memory_mib=1024)


def only_failure(t: NodeTable, shape: Shape) -> dict[str, int]:
    res = t.filter(shape)
    assert res.eligible.tolist() == [0]  # node "ok" is always index 0
    return res.failures


# --------------------------------------------------------------------- one test per filter


@pytest.mark.parametrize(
    "state, code",
    [("cordoned", R.NODE_CORDONED), ("draining", R.NODE_DRAINING),
     ("maintenance", R.NODE_MAINTENANCE), ("lost", R.NODE_LOST)],
)
def test_a_node_that_is_not_ready_is_counted_under_its_state(state: str, code: str) -> None:
    t = table_of(("ok", caps()), ("bad", caps(), state))
    assert only_failure(t, SMALL) == {code: 1}


def test_a_node_of_another_cpu_arch_fails_arch_mismatch() -> None:
    t = table_of(("ok", caps(cpu_arch="arm64")), ("bad", caps(cpu_arch="amd64")))
    assert only_failure(t, Shape.build(cpu_millis=1, cpu_arch="arm64")) == {R.ARCH_MISMATCH: 1}


def test_a_node_with_another_gpu_model_fails_gpu_model_mismatch() -> None:
    t = table_of(("ok", caps(gpu_count=1, gpu_model="H100")),
                 ("bad", caps(gpu_count=1, gpu_model="A100")), ("cpu", caps()))
    shape = Shape.build(gpu_count=1, gpu_model="H100")
    assert only_failure(t, shape) == {R.GPU_MODEL_MISMATCH: 2, R.INSUFFICIENT_GPU: 1}


def test_a_gpu_model_no_node_has_matches_nothing() -> None:
    t = table_of(("a", caps(gpu_count=1, gpu_model="A100")))
    res = t.filter(Shape.build(gpu_count=1, gpu_model="B200"))
    assert res.failures == {R.GPU_MODEL_MISMATCH: 1} and res.never_satisfiable


def test_a_node_with_too_little_gpu_memory_fails_insufficient_gpu_memory() -> None:
    t = table_of(("ok", caps(gpu_count=1, gpu_memory_gib=80)),
                 ("bad", caps(gpu_count=1, gpu_memory_gib=24)))
    shape = Shape.build(gpu_count=1, gpu_memory_gib_min=40)
    assert only_failure(t, shape) == {R.INSUFFICIENT_GPU_MEMORY: 1}


def test_a_node_without_the_mig_profile_fails_gpu_partition_unavailable() -> None:
    t = table_of(("ok", caps(extended=(("gpu/1g.10gb", 7),))),
                 ("bad", caps(gpu_count=8)))
    shape = Shape.build(cpu_millis=1, gpu_partition="1g.10gb")
    # The whole-GPU node is not double counted as insufficient_gpu.
    assert only_failure(t, shape) == {R.GPU_PARTITION_UNAVAILABLE: 1}


def test_a_full_partition_profile_is_insufficient_gpu_not_unavailable() -> None:
    t = table_of(("ok", caps(extended=(("gpu/1g.10gb", 7),))),
                 ("full", caps(extended=(("gpu/1g.10gb", 1),))))
    t.allocate("full", "l1", Resources(extended=(("gpu/1g.10gb", 1),)))
    res = t.filter(Shape.build(cpu_millis=1, gpu_partition="1g.10gb"))
    assert res.eligible.tolist() == [0]
    assert res.failures == {R.INSUFFICIENT_GPU: 1}


def test_a_partition_profile_no_node_offers_is_never_satisfiable() -> None:
    t = table_of(("a", caps(gpu_count=1)))
    res = t.filter(Shape.build(cpu_millis=1, gpu_partition="3g.40gb"))
    assert res.failures == {R.GPU_PARTITION_UNAVAILABLE: 1} and res.never_satisfiable


def test_a_node_without_the_runtime_class_fails_isolation_unavailable() -> None:
    t = table_of(("ok", caps(runtimes=("container", "microvm"))), ("bad", caps()))
    shape = Shape.build(cpu_millis=1, runtime="microvm")
    assert only_failure(t, shape) == {R.ISOLATION_UNAVAILABLE: 1}


def test_a_node_of_a_refused_trust_level_fails_isolation_unavailable() -> None:
    t = table_of(("ok", caps()), ("bad", caps(trust_level="marketplace")))
    res = t.filter(SMALL, allowed_trust_levels={"trusted"})
    assert res.eligible.tolist() == [0] and res.failures == {R.ISOLATION_UNAVAILABLE: 1}


def test_a_node_with_less_open_egress_fails_network_unavailable() -> None:
    t = table_of(("ok", caps(network_egress="open")), ("bad", caps(network_egress="restricted")))
    shape = Shape.build(cpu_millis=1, network_egress="open")
    assert only_failure(t, shape) == {R.NETWORK_UNAVAILABLE: 1}


def test_a_node_with_too_little_bandwidth_fails_network_unavailable() -> None:
    t = table_of(("ok", caps(bandwidth_mbps=10_000)), ("bad", caps(bandwidth_mbps=1000)))
    shape = Shape.build(cpu_millis=1, bandwidth_mbps_min=5000)
    assert only_failure(t, shape) == {R.NETWORK_UNAVAILABLE: 1}


def test_a_node_in_another_region_fails_region_mismatch() -> None:
    t = table_of(("ok", caps(region="eu")), ("bad", caps(region="us")))
    assert only_failure(t, Shape.build(cpu_millis=1, region="eu")) == {R.REGION_MISMATCH: 1}


def test_a_node_in_another_zone_fails_zone_mismatch() -> None:
    t = table_of(("ok", caps(zone="z1")), ("bad", caps(zone="z2")))
    assert only_failure(t, Shape.build(cpu_millis=1, zone="z1")) == {R.ZONE_MISMATCH: 1}


@pytest.mark.parametrize(
    "dim, code",
    [("cpu_millis", R.INSUFFICIENT_CPU), ("memory_mib", R.INSUFFICIENT_MEMORY),
     ("gpu_count", R.INSUFFICIENT_GPU), ("local_disk_gib", R.INSUFFICIENT_DISK)],
)
def test_a_node_short_of_one_dimension_fails_that_capacity_reason(dim: str, code: str) -> None:
    t = table_of(("ok", caps(**{dim: 10})), ("bad", caps(**{dim: 5})))
    assert only_failure(t, Shape.build(**{dim: 8})) == {code: 1}


def test_a_node_failing_several_filters_is_counted_under_each() -> None:
    t = table_of(("ok", caps(zone="z1")), ("bad", caps(zone="z2", cpu_millis=10), "cordoned"))
    fails = only_failure(t, Shape.build(cpu_millis=1000, zone="z1"))
    assert fails == {R.NODE_CORDONED: 1, R.ZONE_MISMATCH: 1, R.INSUFFICIENT_CPU: 1}


def test_wait_reasons_render_the_filter_counts_and_tenant_codes() -> None:
    t = table_of(("a", caps(cpu_millis=500)))
    wr = t.filter(SMALL).wait_reasons([R.QUOTA_EXCEEDED])
    assert wr.to_dict() == {
        "nodes_total": 1, "filters": {R.INSUFFICIENT_CPU: 1},
        "tenant": [R.QUOTA_EXCEEDED], "never_satisfiable": True,
    }
    assert R.WaitReasons.from_dict(wr.to_dict()) == wr
    assert "insufficient_cpu" in wr.summary()


# --------------------------------------------------------------------- never vs busy


def test_a_request_larger_than_any_node_is_never_satisfiable() -> None:
    t = table_of(("a", caps(cpu_millis=4000)), ("b", caps(cpu_millis=8000)))
    res = t.filter(Shape.build(cpu_millis=16_000))
    assert res.never_satisfiable and res.fit_when_empty == 0
    assert res.failures == {R.INSUFFICIENT_CPU: 2}


def test_a_request_that_fits_an_empty_node_but_not_now_is_busy_not_unsatisfiable() -> None:
    t = table_of(("a", caps(cpu_millis=8000)), ("b", caps(cpu_millis=4000)))
    t.allocate("a", "l1", Resources(cpu_millis=6000))
    res = t.filter(Shape.build(cpu_millis=6000))
    assert not res.satisfiable_now and not res.never_satisfiable
    assert res.fit_when_empty == 1 and res.busy.tolist() == [0]
    assert res.failures == {R.INSUFFICIENT_CPU: 2}


def test_a_fitting_node_that_is_only_cordoned_keeps_the_request_satisfiable() -> None:
    t = table_of(("a", caps(), "cordoned"))
    res = t.filter(SMALL)
    assert not res.satisfiable_now and not res.never_satisfiable and res.busy.size == 0


def test_a_static_mismatch_makes_a_request_never_satisfiable_even_with_free_capacity() -> None:
    t = table_of(("a", caps(cpu_arch="amd64")))
    assert t.filter(Shape.build(cpu_millis=1, cpu_arch="arm64")).never_satisfiable


def test_an_empty_table_is_not_evidence_of_unsatisfiability() -> None:
    res = NodeTable().filter(SMALL)
    assert res.nodes_total == 0 and not res.never_satisfiable and res.eligible.size == 0


# --------------------------------------------------------------------- ranking


def test_best_fit_packs_onto_the_fullest_node_that_fits() -> None:
    t = table_of(("a", caps()), ("b", caps()), ("c", caps()))
    t.allocate("b", "l0", Resources(cpu_millis=4000, memory_mib=8192))
    shape = Shape.build(cpu_millis=2000, memory_mib=4096)
    placed = []
    for i in range(4):
        node, _ = t.place(shape)
        assert node is not None
        t.allocate(node, f"l{i + 1}", shape.resources)
        placed.append(node)
    # b fills up first (two more fit), then one node is packed before the last is touched.
    assert placed[:2] == ["b", "b"]
    assert placed[2] == placed[3]


def test_best_fit_keeps_gpu_nodes_for_gpu_work() -> None:
    t = table_of(("gpu", caps(gpu_count=8)), ("cpu", caps()))
    assert t.place(SMALL)[0] == "cpu"
    assert t.place(Shape.build(cpu_millis=1000, gpu_count=1))[0] == "gpu"


def test_spread_places_across_failure_domains() -> None:
    nodes = [(f"n{i}", caps(failure_domain=f"rack{i % 3}")) for i in range(6)]
    t = table_of(*nodes)
    domains = []
    for i in range(3):
        node, _ = t.place(SMALL, packing="spread")
        assert node is not None
        t.allocate(node, f"l{i}", SMALL.resources, tenant="t1")
        domains.append(node[1:])
    assert sorted(int(n) % 3 for n in domains) == [0, 1, 2]
    assert t.failure_domain_counts("t1").tolist() == [1, 1, 1]


def test_spread_uses_the_tenants_own_counts_when_given() -> None:
    t = table_of(("a", caps(failure_domain="r1")), ("b", caps(failure_domain="r2")))
    t.allocate("a", "other", SMALL.resources, tenant="t2")
    t.allocate("b", "mine", SMALL.resources, tenant="t1")
    res = t.filter(SMALL)
    # All allocations are even (1 and 1); t1's own are in r2, so spread for t1 picks r1.
    order = t.rank(SMALL, res.eligible, "spread", t.failure_domain_counts("t1"))
    assert t.node_id_at(int(order[0])) == "a"
    by_name = t.rank(SMALL, res.eligible, "spread", {"r1": 5})
    assert t.node_id_at(int(by_name[0])) == "b"


def test_a_higher_ranked_preference_outweighs_all_lower_ones() -> None:
    t = table_of(
        ("zone-only", caps(zone="z1")),
        ("image-and-label", caps(zone="z2", image_cache=("img",), labels=(("tier", "gold"),))),
    )
    shape = Shape.build(
        cpu_millis=1,
        preferences=[("zone", "z1"), ("image_cached", "img"), ("node_label", "tier=gold")],
    )
    assert t.place(shape)[0] == "zone-only"
    flipped = Shape.build(cpu_millis=1, preferences=[("image_cached", "img"), ("zone", "z1")])
    assert t.place(flipped)[0] == "image-and-label"


def test_preferences_beat_packing_and_unknown_kinds_are_ignored() -> None:
    t = table_of(("busy", caps(region="r1")), ("idle", caps(region="r2", gpu_model="L4")))
    t.allocate("busy", "l", Resources(cpu_millis=6000))
    assert t.place(SMALL)[0] == "busy"
    assert t.place(Shape.build(cpu_millis=1, preferences=[("gpu_model", "L4")]))[0] == "idle"
    assert t.place(Shape.build(cpu_millis=1, preferences=[("weather", "sunny")]))[0] == "busy"


def test_rank_with_a_limit_returns_the_head_of_the_full_order() -> None:
    t = table_of(*[(f"n{i}", caps(cpu_millis=1000 * (i % 7 + 2))) for i in range(40)])
    res = t.filter(SMALL)
    full = t.rank(SMALL, res.eligible)
    assert t.rank(SMALL, res.eligible, limit=5).tolist() == full[:5].tolist()
    assert t.rank(SMALL, res.eligible, "spread", limit=3).tolist() == t.rank(
        SMALL, res.eligible, "spread")[:3].tolist()


# --------------------------------------------------------------------- bookkeeping


def test_allocate_refuses_past_allocatable_and_free_is_idempotent() -> None:
    t = table_of(("a", caps(cpu_millis=1000)))
    t.allocate("a", "l1", Resources(cpu_millis=600))
    with pytest.raises(CapacityError):
        t.allocate("a", "l2", Resources(cpu_millis=600))
    with pytest.raises(ValueError):
        t.allocate("a", "l1", Resources(cpu_millis=1))
    assert t.free("l1") and not t.free("l1")
    assert t.free_resources("a").cpu_millis == 1000


def test_a_new_extended_dimension_grows_the_matrices() -> None:
    t = table_of(("a", caps()))
    t.allocate("a", "l1", Resources(cpu_millis=100))
    t.add_or_update_node("b", caps(extended=(("gpu/2g.20gb", 3),)))
    assert "gpu/2g.20gb" in t.dimensions and t.free_matrix().shape == (2, 5)
    t.allocate("b", "l2", Resources(extended=(("gpu/2g.20gb", 2),)))
    assert t.free("l1") and t.free("l2")
    assert (t.allocated_matrix() == 0).all()


def test_removing_a_node_moves_the_last_row_and_keeps_its_leases() -> None:
    t = table_of(("a", caps(image_cache=("x",))), ("b", caps()), ("c", caps(image_cache=("y",))))
    t.allocate("a", "la", SMALL.resources)
    t.allocate("c", "lc", SMALL.resources)
    assert t.remove_node("a") == ["la"]
    assert t.node_ids == ("c", "b") and t.node_of("lc") == "c"
    assert t.free("lc") and (t.allocated_matrix() == 0).all()
    pref = Shape.build(cpu_millis=1, preferences=[("image_cached", "y")])
    assert t.place(pref)[0] == "c"


def test_a_shrinking_update_leaves_the_node_unable_to_fit_until_leases_end() -> None:
    t = table_of(("a", caps(cpu_millis=4000)))
    t.allocate("a", "l1", Resources(cpu_millis=3000))
    t.add_or_update_node("a", caps(cpu_millis=2000))
    assert not t.filter(Shape.build(cpu_millis=1)).satisfiable_now
    t.free("l1")
    assert t.filter(Shape.build(cpu_millis=1)).satisfiable_now


# --------------------------------------------------------------------- property

DIMS = ("cpu_millis", "memory_mib", "gpu_count", "local_disk_gib", "gpu/1g.10gb")


def _res(v: list[int]) -> Resources:
    return Resources(v[0], v[1], v[2], v[3], extended=((DIMS[4], v[4]),))


node_caps = st.builds(
    lambda v, zone, state: (caps(cpu_millis=v[0], memory_mib=v[1], gpu_count=v[2],
                                 local_disk_gib=v[3], extended=((DIMS[4], v[4]),), zone=zone),
                            state),
    st.lists(st.integers(0, 8), min_size=5, max_size=5),
    st.sampled_from(["z1", "z2"]),
    st.sampled_from(["ready", "ready", "cordoned"]),
)
ops = st.lists(
    st.tuples(st.booleans(), st.integers(0, 7), st.lists(st.integers(0, 4), min_size=5,
                                                          max_size=5)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(node_caps, min_size=1, max_size=8), ops,
       st.lists(st.integers(0, 6), min_size=5, max_size=5), st.sampled_from([None, "z1"]))
def test_allocations_never_exceed_allocatable_and_filter_only_returns_fitting_nodes(
    nodes: list[tuple[NodeCapabilities, str]],
    operations: list[tuple[bool, int, list[int]]],
    request: list[int],
    zone: str | None,
) -> None:
    t = NodeTable(initial_capacity=1)
    for i, (c, state) in enumerate(nodes):
        t.add_or_update_node(f"n{i}", c, state)
    live: dict[str, tuple[int, list[int]]] = {}
    for k, (alloc, target, amounts) in enumerate(operations):
        if alloc:
            node = target % len(nodes)
            try:
                t.allocate(f"n{node}", f"l{k}", _res(amounts))
                live[f"l{k}"] = (node, amounts)
            except CapacityError:
                pass
        elif live:
            lease = sorted(live)[target % len(live)]
            assert t.free(lease)
            del live[lease]
    alloc_m, used = t.allocatable_matrix(), t.allocated_matrix()
    assert (used <= alloc_m).all() and (used >= 0).all()
    expected = np.zeros_like(used)
    for node, amounts in live.values():
        # a dimension no node or lease ever named a non-zero amount of has no column
        present = [(t.dimensions.index(d), a) for d, a in zip(DIMS, amounts) if d in t.dimensions]
        assert all(a == 0 for d, a in zip(DIMS, amounts) if d not in t.dimensions)
        for col, a in present:
            expected[node, col] += a
    assert (used == expected).all()

    shape = Shape.build(cpu_millis=request[0], memory_mib=request[1], gpu_count=request[2],
                        local_disk_gib=request[3], zone=zone)
    res = t.filter(shape)
    free = t.free_matrix()
    req = np.array([request[0], request[1], request[2], request[3]] +
                   [0] * (len(t.dimensions) - 4))
    naive = [
        i for i, (c, state) in enumerate(nodes)
        if state == "ready" and (zone is None or c.zone == zone) and (free[i] >= req).all()
    ]
    assert res.eligible.tolist() == naive
    never = not any((zone is None or c.zone == zone) and (alloc_m[i] >= req).all()
                    for i, (c, _) in enumerate(nodes))
    assert res.never_satisfiable == never
    ranked = t.rank(shape, res.eligible)
    assert sorted(ranked.tolist()) == naive
