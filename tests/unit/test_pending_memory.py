"""Queued leases held compactly: rebuilt exactly as the library folds their events."""

from __future__ import annotations

from typing import Any

from domain.lease import Lease, LeaseState
from domain.resources import NodeId, PoolId, Shape, TenantId
from workers.pending import LeaseMemory, QueuedLease


def _queued(key: str, **kw: Any) -> tuple[Lease, list[Any]]:
    lease = Lease.request(tenant_id=TenantId("alpha"), pool_id=PoolId("p1"),
                          idempotency_key=key, shape=Shape.build(cpu_millis=1000, memory_mib=512),
                          maximum_runtime_seconds=600, now=1_800_000_000.0,
                          priority_class="standard", **kw)
    lease.queue(1_800_000_001.0)
    events = list(lease.collect_events())
    return lease, events


def _library_fold(events: list[Any]) -> Any:
    agg = None
    for e in events:
        agg = e.mutate(agg)
    return agg


def test_a_queued_lease_is_held_as_a_record_and_rebuilt_as_the_library_folds_it() -> None:
    memory = LeaseMemory()
    _lease, events = _queued("k1", trace_parent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                             request_digest="d" * 64)
    assert memory.absorb(events[0]) is True  # requested: kept, not yet queued
    record = memory.absorb(events[1])
    assert isinstance(record, QueuedLease)
    oid = events[0].originator_id
    assert oid not in memory.full and memory.version_of(oid) == 2
    assert memory.peek(oid) is record
    assert record.tenant_id == "alpha" and record.maximum_runtime_seconds == 600
    expected = _library_fold(events)
    whole = memory.get(oid)
    assert type(whole) is Lease and whole.__dict__ == expected.__dict__
    assert memory.full[oid] is whole and oid not in memory.queued  # kept whole from now on


def test_a_rebuilt_lease_records_the_same_next_event_as_the_original() -> None:
    memory = LeaseMemory()
    original, events = _queued("k2")
    for e in events:
        memory.absorb(e)
    rebuilt = memory.get(events[0].originator_id)
    for lease in (original, rebuilt):
        lease.reserve(1_800_000_002.0, node_id=NodeId("n1"), commit_timeout_seconds=30,
                      hold_microcredits=7)
    mine, theirs = rebuilt.collect_events(), original.collect_events()
    assert len(mine) == len(theirs) == 1
    strip = {"timestamp"}
    assert ({k: v for k, v in mine[0].__dict__.items() if k not in strip}
            == {k: v for k, v in theirs[0].__dict__.items() if k not in strip})
    assert rebuilt.state is LeaseState.RESERVED and rebuilt.version == 3


def test_a_lease_examined_and_left_waiting_is_compacted_again_but_never_with_unsaved_events(
) -> None:
    memory = LeaseMemory()
    _lease, events = _queued("k3")
    for e in events:
        memory.absorb(e)
    oid = events[0].originator_id
    whole = memory.get(oid)
    assert memory.compact(whole) and oid in memory.queued
    assert memory.get(oid).__dict__ == _library_fold(events).__dict__
    again = memory.get(oid)
    again.reject(1_800_000_003.0, "unschedulable")  # an unsaved event: stays whole
    assert not memory.compact(again) and memory.full[oid] is again


def test_anything_but_a_plain_request_and_its_queueing_is_folded_whole() -> None:
    memory = LeaseMemory()
    lease, events = _queued("k4")
    lease.reject(1_800_000_004.0, "quota")
    rejected = lease.collect_events()
    for e in events:
        memory.absorb(e)
    assert memory.absorb(rejected[0]) is False  # the caller folds it on the whole lease
    whole = memory.get(events[0].originator_id)
    folded = rejected[0].mutate(whole)
    assert folded.state is LeaseState.REJECTED
    assert memory.full[events[0].originator_id] is folded


def test_identical_shapes_are_shared_between_records() -> None:
    memory = LeaseMemory()
    for key in ("a", "b"):
        for e in _queued(key)[1]:
            memory.absorb(e)
    first, second = memory.queued.values()
    assert first.requested_shape is second.requested_shape


def test_a_promoted_lease_keeps_its_records_shared_shape_rather_than_a_parsed_copy() -> None:
    # preferences keep a shape out of Shape.from_dict's own cache: only handing the shared
    # Shape over as it is gives the whole lease that very object
    memory = LeaseMemory()
    shape = Shape.build(cpu_millis=1000, memory_mib=512, preferences=(("zone", "z1"),))
    lease = Lease.request(tenant_id=TenantId("alpha"), pool_id=PoolId("p1"),
                          idempotency_key="k5", shape=shape, maximum_runtime_seconds=600,
                          now=1_800_000_000.0, priority_class="standard", queued=True)
    events = list(lease.collect_events())
    record = memory.absorb(events[0])
    assert isinstance(record, QueuedLease)
    whole = memory.get(record.id)
    assert whole.requested_shape is record.requested_shape is whole.shape
    assert whole.__dict__ == _library_fold(events).__dict__


def test_a_request_from_before_some_fields_is_still_held_compactly_and_rebuilt_alike() -> None:
    # an event written before gangs, names, labels, workflows and arrays lacks those fields:
    # the record marks them missing, and the rebuild leaves them to the init's defaults
    memory = LeaseMemory()
    _lease, events = _queued("k6")
    for name in ("gang", "name", "labels", "workflow", "array", "queue_timeout_seconds"):
        del events[0].__dict__[name]
    assert memory.absorb(events[0]) is True
    record = memory.absorb(events[1])
    assert isinstance(record, QueuedLease) and record.gang is None
    assert memory.get(record.id).__dict__ == _library_fold(events).__dict__
