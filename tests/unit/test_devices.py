"""Concrete GPU devices: the best-fit choice, the node ledger's refusals, and a property test
that no order of reserve / release / void / preempt ever puts two leases on one device."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.devices import Device, choose_devices, inventory_problems
from domain.errors import DeviceUnavailable
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.resources import LeaseId, NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId


def gpus(n: int, *, domains: int = 1, model: str = "NVIDIA A100 80GB",
         memory_gib: int = 80) -> tuple[Device, ...]:
    per = max(1, n // domains)
    return tuple(Device(id=f"GPU-{i:04d}", model=model, memory_mib=memory_gib * 1024, minor=i,
                        nvlink_domain=f"nv{i // per}") for i in range(n))


def node_with(devices: tuple[Device, ...], *, partitions: dict[str, int] | None = None) -> Node:
    ext = tuple((f"gpu/{p}", k) for p, k in (partitions or {}).items())
    whole = sum(1 for d in devices if d.kind == "gpu")
    caps = NodeCapabilities(allocatable=Resources(64000, 512 * 1024, whole, 1000, extended=ext),
                            gpu_model="NVIDIA A100 80GB", gpu_memory_gib=80, devices=devices)
    return Node.register(node_id=NodeId("n1"), pool_id=PoolId("p"), capabilities=caps, now=0.0)


def gpu_shape(n: int, **kw: Any) -> Shape:
    return Shape.build(cpu_millis=1000, memory_mib=1024, gpu_count=n, **kw)


# -- choice ------------------------------------------------------------------------------------


def test_a_lease_that_fits_one_nvlink_domain_gets_the_fullest_one_that_fits() -> None:
    devs = gpus(8, domains=2)  # nv0: GPU-0..3, nv1: GPU-4..7
    held = {"GPU-0000", "GPU-0001"}  # nv0 has 2 free, nv1 has 4 free
    assert choose_devices(devs, held, gpu_shape(2)) == ("GPU-0002", "GPU-0003")
    assert choose_devices(devs, held, gpu_shape(3)) == ("GPU-0004", "GPU-0005", "GPU-0006")


def test_a_lease_larger_than_any_domain_is_split_over_the_fewest_domains() -> None:
    devs = gpus(8, domains=4)  # pairs
    held = {"GPU-0000", "GPU-0002"}  # nv0 and nv1 have one free each; nv2, nv3 two each
    got = choose_devices(devs, held, gpu_shape(4))
    assert got is not None and set(got) == {"GPU-0004", "GPU-0005", "GPU-0006", "GPU-0007"}


def test_per_device_memory_and_model_filters_leave_unfit_devices_out() -> None:
    small = tuple(Device(id=f"S{i}", model="NVIDIA L4", memory_mib=24 * 1024, minor=i)
                  for i in range(2))
    big = tuple(Device(id=f"B{i}", model="NVIDIA A100 80GB", memory_mib=80 * 1024, minor=2 + i)
                for i in range(2))
    devs = small + big
    assert choose_devices(devs, set(), gpu_shape(2, gpu_memory_gib_min=40)) == ("B0", "B1")
    assert choose_devices(devs, set(), gpu_shape(3, gpu_memory_gib_min=40)) is None
    assert choose_devices(devs, set(), gpu_shape(1, gpu_model="NVIDIA L4")) == ("S0",)


def test_mig_instances_and_time_slice_replicas_are_chosen_by_profile_packed_per_gpu() -> None:
    devs = (
        Device(id="MIG-a", kind="mig", profile="1g.10gb", parent="GPU-1", minor=1),
        Device(id="MIG-b", kind="mig", profile="1g.10gb", parent="GPU-1", minor=1),
        Device(id="MIG-c", kind="mig", profile="3g.40gb", parent="GPU-1", minor=1),
        Device(id="GPU-2/ts0", kind="replica", profile="time-slice", parent="GPU-2", minor=2),
        Device(id="GPU-2/ts1", kind="replica", profile="time-slice", parent="GPU-2", minor=2),
    )
    mig = Shape.build(cpu_millis=100, memory_mib=100, gpu_count=1, gpu_partition="1g.10gb")
    ts = Shape.build(cpu_millis=100, memory_mib=100, gpu_count=1, gpu_partition="time-slice")
    assert choose_devices(devs, set(), mig) == ("MIG-a",)
    assert choose_devices(devs, {"MIG-a", "MIG-b"}, mig) is None
    assert choose_devices(devs, {"GPU-2/ts0"}, ts) == ("GPU-2/ts1",)
    assert devs[3].uuid == "GPU-2"  # a replica is passed on as its GPU


def test_a_shape_without_gpus_or_a_node_without_an_inventory_binds_nothing() -> None:
    assert choose_devices(gpus(2), set(), Shape.build(cpu_millis=1, memory_mib=1)) == ()
    assert choose_devices((), set(), gpu_shape(2)) == ()


def test_an_inventory_that_disagrees_with_the_offered_counts_is_named() -> None:
    alloc = Resources(1000, 1000, 2, 0, extended=(("gpu/1g.10gb", 1),))
    ok = gpus(2) + (Device(id="M", kind="mig", profile="1g.10gb", parent="G"),)
    assert inventory_problems(ok, alloc) == []
    assert inventory_problems(gpus(3), alloc) != []
    assert any("twice" in p for p in inventory_problems(gpus(1) * 2, Resources(gpu_count=2)))


# -- the node ledger ---------------------------------------------------------------------------


def test_the_node_refuses_a_device_another_lease_holds() -> None:
    node = node_with(gpus(4))
    node.allocate(LeaseId("a"), Resources(1000, 1024, 2), 1.0, ("GPU-0000", "GPU-0001"))
    with pytest.raises(DeviceUnavailable) as e:
        node.allocate(LeaseId("b"), Resources(1000, 1024, 1), 1.0, ("GPU-0001",))
    assert e.value.code == "device_unavailable"
    with pytest.raises(DeviceUnavailable):  # in one batch, too
        node.allocate_many([(LeaseId("b"), Resources(1000, 1024, 1), ("GPU-0002",)),
                            (LeaseId("c"), Resources(1000, 1024, 1), ("GPU-0002",))], 1.0)
    assert node.held_devices == {"GPU-0000": "a", "GPU-0001": "a"}


def test_the_node_refuses_devices_not_its_own_or_not_matching_the_count() -> None:
    node = node_with(gpus(4))
    with pytest.raises(DeviceUnavailable):
        node.allocate(LeaseId("a"), Resources(1000, 1024, 1), 1.0, ("GPU-elsewhere",))
    with pytest.raises(DeviceUnavailable):  # two GPUs asked, one bound
        node.allocate(LeaseId("a"), Resources(1000, 1024, 2), 1.0, ("GPU-0000",))
    with pytest.raises(DeviceUnavailable):  # a node with an inventory binds every GPU it gives
        node.allocate(LeaseId("a"), Resources(1000, 1024, 1), 1.0)
    node.allocate(LeaseId("cpu"), Resources(1000, 1024, 0), 1.0)  # no GPU: nothing to bind


def test_freeing_returns_exactly_the_leases_devices_and_a_refold_agrees() -> None:
    node = node_with(gpus(4))
    node.allocate_many([(LeaseId("a"), Resources(1000, 1024, 1), ("GPU-0000",)),
                        (LeaseId("b"), Resources(1000, 1024, 2), ("GPU-0001", "GPU-0002"))], 1.0)
    node.free(LeaseId("a"), 2.0)
    assert node.held_devices == {"GPU-0001": "b", "GPU-0002": "b"}
    assert node.devices_of(LeaseId("b")) == ("GPU-0001", "GPU-0002")
    refolded = None
    for ev in node.collect_events():
        refolded = ev.mutate(refolded)
    assert isinstance(refolded, Node) and refolded.held_devices == node.held_devices


def test_a_lease_records_its_devices_with_the_reservation_and_forgets_them_on_requeue() -> None:
    lease = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=gpu_shape(1), maximum_runtime_seconds=600, now=0.0)
    lease.queue(0.0)
    lease.reserve(1.0, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=0,
                  devices=("GPU-0003",))
    assert lease.devices == ("GPU-0003",)
    refolded = None
    for ev in lease.collect_events():
        refolded = ev.mutate(refolded)
    assert isinstance(refolded, Lease) and refolded.devices == ("GPU-0003",)


def test_old_events_without_devices_still_fold() -> None:
    node = node_with(gpus(2))
    node.allocate(LeaseId("a"), Resources(1000, 1024, 1), 1.0, ("GPU-0000",))
    events = node.collect_events()
    # an allocation recorded before device inventories carried no `devices` field
    legacy = Node.register(node_id=NodeId("old"), pool_id=PoolId("p"),
                           capabilities=NodeCapabilities(allocatable=Resources(1000, 1000, 1)),
                           now=0.0)
    legacy._capacity_allocated(lease_id="x", resources=Resources(100, 100, 1).to_dict(), at=1.0)
    assert legacy.devices_of(LeaseId("x")) == () and legacy.allocated.gpu_count == 1
    assert events[-1].devices == ["GPU-0000"]  # type: ignore[attr-defined]


# -- property: never two leases on one device --------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["request", "commit", "release", "void", "preempt",
                                          "cancel"]),
                         st.integers(0, 7), st.integers(1, 4)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 4))
def test_no_order_of_reserve_release_void_preempt_puts_two_leases_on_one_device(
        ops: list[tuple[str, int, int]], domains: int) -> None:
    node = node_with(gpus(8, domains=domains))
    inventory = {d.id for d in node.capabilities.devices}
    leases: dict[int, Lease] = {}
    now = 1.0
    for verb, k, n in ops:
        now += 1.0
        lease = leases.get(k)
        if verb == "request" and (lease is None or lease.is_terminal):
            lease = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"),
                                  idempotency_key=f"k{k}-{now}", shape=gpu_shape(n),
                                  maximum_runtime_seconds=3600, now=now)
            lease.queue(now)
            chosen = choose_devices(node.capabilities.devices, node.held_devices, lease.shape)
            if chosen is not None:
                lease.reserve(now, node_id=NodeId("n1"), commit_timeout_seconds=30,
                              hold_microcredits=0, devices=chosen)
                node.allocate(lease.lease_id, lease.resources, now, chosen)
                assert node.devices_of(lease.lease_id) == lease.devices == chosen
            leases[k] = lease
        elif lease is None:
            continue
        elif verb == "commit" and lease.state is LeaseState.RESERVED:
            lease.commit(now)
        elif verb == "release" and lease.state is LeaseState.RUNNING:
            lease.release(now)
        elif verb == "void" and lease.state is LeaseState.RESERVED:
            lease.void_reservation(now + 60)
        elif verb == "preempt" and lease.state is LeaseState.RUNNING:
            lease.notice_preemption(now, grace_seconds=5, requeue=False)
            lease.confirm_stopped(now)
        elif verb == "cancel" and lease.state in (LeaseState.RESERVED, LeaseState.QUEUED):
            lease.cancel(now)
        if not lease.holds_capacity:
            node.free(lease.lease_id, now)
        holders: dict[str, str] = {}
        for lid in node.allocations:
            for d in node.devices_of(lid):
                assert d not in holders, f"{d} held by {holders[d]} and {lid}"
                holders[d] = lid
        assert holders == node.held_devices
        assert set(holders) <= inventory
        assert sum(1 for _ in holders) == node.allocated.gpu_count


def test_an_enrollment_counts_mig_instances_and_replicas_as_the_gpu_they_are_carved_from() -> None:
    from domain.enrollment import Enrollment
    from domain.errors import NodeClaimRefused

    mig = tuple(Device(id=f"MIG-{g}-{k}", kind="mig", profile="1g.10gb", parent=f"GPU-{g}")
                for g in range(2) for k in range(3))
    claim = NodeCapabilities(allocatable=Resources(1000, 1000, 0, 0,
                                                   extended=(("gpu/1g.10gb", 6),)),
                             devices=mig)
    two = Enrollment.enroll(node_id=NodeId("n"), pool_id=PoolId("p"), trust_level="trusted",
                            max_gpus=2, max_cpu_millis=None, max_memory_mib=None,
                            gpu_model=None, now=0.0)
    assert two.admit("p", claim).devices == mig  # 2 GPUs in 6 MIG instances: within 2
    one = Enrollment.enroll(node_id=NodeId("n"), pool_id=PoolId("p"), trust_level="trusted",
                            max_gpus=1, max_cpu_millis=None, max_memory_mib=None,
                            gpu_model=None, now=0.0)
    with pytest.raises(NodeClaimRefused):
        one.admit("p", claim)
