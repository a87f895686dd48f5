"""A node's capacity ledger: allocations never exceed allocatable, only ready nodes take work.

Re-registration and state changes keep allocations: the workloads behind them may still run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain import (
    AlreadyAllocated,
    IllegalTransition,
    InvalidAmount,
    LeaseId,
    Node,
    NodeCapabilities,
    NodeId,
    NodeNotEmpty,
    NodeNotSchedulable,
    NodeState,
    OverAllocation,
    PoolId,
    Resources,
    Shape,
    UnknownAllocation,
)
from domain.resources import partition_dimension

ALLOCATABLE = Resources(cpu_millis=8000, memory_mib=32768, gpu_count=2, local_disk_gib=100)
CAPS = NodeCapabilities(allocatable=ALLOCATABLE, gpu_model="H100", gpu_memory_gib=80)
SMALL = Resources(cpu_millis=2000, memory_mib=8192, gpu_count=1)


def new_node(capabilities: NodeCapabilities = CAPS) -> Node:
    return Node.register(node_id=NodeId("n1"), pool_id=PoolId("gpu"),
                         capabilities=capabilities, now=0)


def state_of(agg: Any) -> dict[str, Any]:
    return {k: v for k, v in agg.__dict__.items() if k != "_pending_events"}


def replay(node: Node) -> Any:
    agg = None
    for e in node.pending_events:
        agg = e.mutate(agg)
    return agg


def test_a_node_id_maps_to_one_aggregate() -> None:
    assert new_node().id == Node.create_id("n1") != Node.create_id("n2")


def test_allocated_and_free_capacity_track_allocations() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    node.allocate(LeaseId("b"), SMALL, now=2)
    assert node.allocated == SMALL + SMALL
    assert node.free_capacity == ALLOCATABLE - SMALL - SMALL
    assert node.allocations == {"a": SMALL, "b": SMALL}
    assert node.free(LeaseId("a"), now=3) is True
    assert node.allocated == SMALL
    assert [type(e).__name__ for e in node.pending_events] == [
        "NodeRegistered", "CapacityAllocated", "CapacityAllocated", "CapacityFreed",
    ]
    assert state_of(replay(node)) == state_of(node)


def test_allocation_never_exceeds_allocatable_and_names_the_dimensions() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    too_big = Resources(cpu_millis=6001, memory_mib=1, gpu_count=2)
    with pytest.raises(OverAllocation) as raised:
        node.allocate(LeaseId("b"), too_big, now=2)
    assert raised.value.code == "insufficient_capacity"
    assert raised.value.dimensions == ("cpu_millis", "gpu_count")
    assert raised.value.reasons == ("cpu_millis", "gpu_count")
    assert node.allocations == {"a": SMALL}
    node.allocate(LeaseId("b"), ALLOCATABLE - SMALL, now=3)  # exactly full is fine
    assert node.free_capacity == Resources()


def test_many_allocations_are_one_event_and_fold_like_single_ones() -> None:
    node, single = new_node(), new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    node.allocate_many([(LeaseId("b"), SMALL), (LeaseId("c"), Resources(cpu_millis=100))], now=2)
    single.allocate(LeaseId("a"), SMALL, now=1)
    single.allocate(LeaseId("b"), SMALL, now=2)
    single.allocate(LeaseId("c"), Resources(cpu_millis=100), now=2)
    assert [type(e).__name__ for e in node.pending_events] == [
        "NodeRegistered", "CapacityAllocated", "CapacityAllocatedBatch"]
    assert node.allocations == single.allocations
    assert node.allocated == single.allocated
    assert state_of(replay(node)) == state_of(node)
    node.free(LeaseId("b"), now=3)
    assert node.allocations == {"a": SMALL, "c": Resources(cpu_millis=100)}


def test_many_allocations_are_all_or_nothing() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    before = len(node.pending_events)
    # each fits alone; together they pass allocatable in gpu_count
    with pytest.raises(OverAllocation) as raised:
        node.allocate_many([(LeaseId("b"), SMALL), (LeaseId("c"), SMALL)], now=2)
    assert raised.value.dimensions == ("gpu_count",)
    with pytest.raises(AlreadyAllocated):
        node.allocate_many([(LeaseId("b"), Resources(cpu_millis=1)), (LeaseId("a"), SMALL)], now=2)
    with pytest.raises(AlreadyAllocated):
        node.allocate_many([(LeaseId("d"), Resources(cpu_millis=1))] * 2, now=2)
    with pytest.raises(InvalidAmount):
        node.allocate_many([(LeaseId("e"), Resources(cpu_millis=-1)),
                            (LeaseId("f"), Resources(cpu_millis=1))], now=2)
    assert len(node.pending_events) == before
    node.cordon(now=2)
    with pytest.raises(NodeNotSchedulable):
        node.allocate_many([(LeaseId("g"), Resources(cpu_millis=1))] * 2, now=3)
    node.allocate_many([], now=4)  # nothing to record
    assert len(node.pending_events) == before + 1  # the cordon only
    assert node.allocations == {"a": SMALL}


def test_a_gpu_partition_is_counted_in_its_own_dimension() -> None:
    slices = Resources(cpu_millis=8000, memory_mib=32768,
                       extended=((partition_dimension("1g.10gb"), 7),))
    node = new_node(NodeCapabilities(allocatable=slices, gpu_model="A100"))
    request = Shape.build(cpu_millis=100, memory_mib=100, gpu_partition="1g.10gb").resources
    for i in range(7):
        node.allocate(LeaseId(f"l{i}"), request, now=i)
    with pytest.raises(OverAllocation) as raised:
        node.allocate(LeaseId("l7"), request, now=8)
    assert raised.value.dimensions == ("gpu/1g.10gb",)
    whole_gpu = Resources(gpu_count=1)
    with pytest.raises(OverAllocation) as raised:
        node.allocate(LeaseId("g"), whole_gpu, now=9)
    assert raised.value.dimensions == ("gpu_count",)


def test_a_lease_cannot_be_allocated_twice() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    with pytest.raises(AlreadyAllocated) as raised:
        node.allocate(LeaseId("a"), SMALL, now=2)
    assert raised.value.code == "already_allocated"
    assert node.allocated == SMALL


def test_freeing_an_unknown_lease_records_nothing() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    node.free(LeaseId("a"), now=2)
    before = len(node.pending_events)
    assert node.free(LeaseId("a"), now=3) is False
    assert node.free(LeaseId("never"), now=3) is False
    assert len(node.pending_events) == before
    with pytest.raises(UnknownAllocation):
        node.allocation_of(LeaseId("never"))


def _cordoned(node: Node) -> None:
    node.cordon(1, reason="kernel upgrade")


def _draining(node: Node) -> None:
    node.drain(1)


def _maintenance(node: Node) -> None:
    node.enter_maintenance(1)


def _lost(node: Node) -> None:
    node.mark_lost(1)


@pytest.mark.parametrize("make", [_cordoned, _draining, _maintenance, _lost])
def test_only_a_ready_node_accepts_allocations(make: Callable[[Node], None]) -> None:
    node = new_node()
    make(node)
    with pytest.raises(NodeNotSchedulable) as raised:
        node.allocate(LeaseId("a"), SMALL, now=2)
    assert raised.value.code == "node_not_schedulable"
    assert raised.value.state == node.state
    assert not node.can_fit(SMALL)


def test_a_lost_node_keeps_its_allocations_and_still_frees_them() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    node.mark_lost(2)
    assert node.allocations == {"a": SMALL}
    assert node.free(LeaseId("a"), now=3) is True
    assert node.allocated == Resources()


def test_reregistration_keeps_allocations_and_brings_a_lost_node_back() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    node.mark_lost(2)
    bigger = NodeCapabilities(allocatable=ALLOCATABLE + SMALL, gpu_model="H100")
    node.reregister(bigger, now=3)
    assert node.state is NodeState.READY
    assert node.allocations == {"a": SMALL}
    assert node.free_capacity == ALLOCATABLE
    assert node.last_heartbeat_at == 3


def test_reregistration_keeps_an_operators_cordon() -> None:
    node = new_node()
    node.cordon(1)
    node.reregister(CAPS, now=2)
    assert node.state is NodeState.CORDONED


def test_a_shrunken_node_reports_overcommit_and_offers_nothing_in_that_dimension() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    node.reregister(NodeCapabilities(allocatable=Resources(cpu_millis=1000, memory_mib=32768,
                                                           gpu_count=2)), now=2)
    assert node.overcommitted_dimensions == ["cpu_millis"]
    assert node.free_capacity.cpu_millis == 0 and node.free_capacity.is_non_negative()
    with pytest.raises(OverAllocation):
        node.allocate(LeaseId("b"), Resources(cpu_millis=1), now=3)


def test_maintenance_requires_an_empty_node() -> None:
    node = new_node()
    node.allocate(LeaseId("a"), SMALL, now=1)
    node.drain(2)
    with pytest.raises(NodeNotEmpty) as raised:
        node.enter_maintenance(3)
    assert raised.value.reasons == ("a",)
    node.free(LeaseId("a"), now=4)
    node.enter_maintenance(5)
    node.end_maintenance(6)
    assert node.state is NodeState.READY


def test_cordon_drain_and_uncordon_move_between_states() -> None:
    node = new_node()
    node.cordon(1)
    node.drain(2)
    assert node.state == NodeState.DRAINING
    with pytest.raises(IllegalTransition):
        node.cordon(3)
    node.uncordon(4)
    assert (node.state, node.is_schedulable) == (NodeState.READY, True)
    with pytest.raises(IllegalTransition) as raised:
        node.uncordon(5)
    assert (raised.value.from_state, raised.value.verb) == ("ready", "uncordon")


def test_a_lost_node_must_reregister_before_heartbeating() -> None:
    node = new_node()
    node.heartbeat(5)
    assert not node.heartbeat_stale(30, timeout_seconds=30)
    assert node.heartbeat_stale(35, timeout_seconds=30)
    node.mark_lost(40)
    with pytest.raises(IllegalTransition):
        node.heartbeat(41)
    with pytest.raises(IllegalTransition):
        node.mark_lost(41)


def test_negative_resources_are_refused() -> None:
    node = new_node()
    with pytest.raises(InvalidAmount):
        node.allocate(LeaseId("a"), Resources(cpu_millis=-1), now=1)
    with pytest.raises(InvalidAmount):
        Node.register(node_id=NodeId("x"), pool_id=PoolId("p"),
                      capabilities=NodeCapabilities(allocatable=Resources(memory_mib=-1)), now=0)


_amount = st.integers(min_value=-5, max_value=5)
_extended = st.one_of(st.just(()), st.lists(
    st.tuples(st.sampled_from(["gpu/1g.10gb", "gpu/3g.40gb"]), _amount), max_size=2))


@given(st.tuples(_amount, _amount, _amount, _amount, _extended),
       st.tuples(_amount, _amount, _amount, _amount, _extended))
def test_resources_fast_paths_agree_with_the_general_rules(a: tuple, b: tuple) -> None:
    """The scalar-only shortcuts (no GPU partitions) give what the per-dimension rules give."""
    x = Resources(*a[:4], extended=tuple(a[4]))
    y = Resources(*b[:4], extended=tuple(b[4]))
    dims = sorted(set(x.dimensions()) | set(y.dimensions()))
    assert x.exceeded_dimensions(y) == [d for d in dims if x.get(d) > y.get(d)]
    assert x.is_non_negative() == all(x.get(d) >= 0 for d in x.dimensions())
    for total, sign in ((x + y, 1), (x - y, -1)):
        for d in dims:
            assert total.get(d) == x.get(d) + sign * y.get(d)
        assert all(v != 0 for _, v in total.extended)
    assert Resources.from_dict(x.to_dict()) == x


@given(st.integers(0, 4), st.integers(0, 64_000), st.sampled_from([None, "H100", "A100"]),
       st.sampled_from(["none", "1g.10gb"]), st.sampled_from([(), (("zone", "z1"),)]),
       st.booleans())
def test_a_remembered_shape_is_the_shape_building_gives(
    gpus: int, cpu: int, model: str | None, partition: str, prefs: tuple, as_float: bool
) -> None:
    """Shape.from_dict remembers plain shapes: what it returns equals a fresh build of the
    same dict, the first time and after, whatever numeric types the JSON carried."""
    shape = Shape.build(cpu_millis=cpu, memory_mib=2048, gpu_count=gpus, gpu_model=model,
                        gpu_partition=partition, preferences=prefs)
    d = shape.to_dict()
    if as_float:  # a writer that sent 1000.0 for 1000
        d["resources"] = {k: float(v) if isinstance(v, int) else v
                          for k, v in d["resources"].items()}
    fresh = Shape._from_dict(d)
    assert fresh == shape
    assert Shape.from_dict(d) == fresh and Shape.from_dict(d) == fresh
    assert Shape.from_dict(shape.to_dict()) == shape
