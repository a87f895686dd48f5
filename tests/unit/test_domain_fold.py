"""domain.fold.trigger makes the same events as the library's @event path, event for event."""

from __future__ import annotations

from typing import Any

import pytest
from eventsourcing.domain import Aggregate, event

from domain import Account, Lease, Node, NodeCapabilities, NodeId, PoolId, Resources
from domain.fold import trigger
from domain.resources import Shape, TenantId


def _fields(ev: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(ev).items() if k != "timestamp"}


def _state(agg: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(agg).items()
            if k not in ("_pending_events", "_modified_on")}


def _lease() -> Lease:
    lease = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=Shape.build(cpu_millis=500, memory_mib=256,
                                            preferences=(("zone", "z1"),)),
                          maximum_runtime_seconds=60, now=1.0, priority_class="standard")
    lease.queue(2.0)
    return lease


def _twins(make: Any) -> tuple[Any, Any]:
    a = make()
    b = type(a).__new__(type(a))
    b.__dict__.update({k: (list(v) if k == "_pending_events" else v)
                       for k, v in a.__dict__.items()})
    # independent copies of the mutable state the methods touch
    for k, v in a.__dict__.items():
        if isinstance(v, (dict, set)):
            b.__dict__[k] = type(v)(v)
    return a, b


@pytest.mark.parametrize("case", ["reserve", "reserve_other_shape", "hold", "allocate_batch"])
def test_the_lean_trigger_makes_the_library_s_event_and_state(case: str) -> None:
    fields: dict[str, Any]
    if case.startswith("reserve"):
        make: Any = _lease
        method = "_reserved"
        shape = Shape.build(cpu_millis=500, memory_mib=256, preferences=(("zone", "z1"),))
        if case == "reserve_other_shape":
            shape = Shape.build(cpu_millis=500, memory_mib=256, gpu_model="H100")
        fields = {"at": 3.0, "node_id": "n1", "shape": shape.to_dict(), "epoch": 1,
                  "reservation_deadline": 63.0, "hold_microcredits": 7}
    elif case == "hold":
        def make() -> Account:
            acc = Account.open(tenant_id=TenantId("t"), now=0.0)
            acc.grant("g", 100, 0.0)
            return acc
        method = "_held"
        fields = {"transfer_id": "x", "lease_id": "l1", "amount": 40, "at": 1.0}
    else:
        def make() -> Node:
            return Node.register(node_id=NodeId("n1"), pool_id=PoolId("p"), now=0.0,
                                 capabilities=NodeCapabilities(
                                     allocatable=Resources(cpu_millis=4000, memory_mib=4096)))
        method = "_capacity_allocated_batch"
        one = Resources(cpu_millis=1000, memory_mib=512).to_dict()
        fields = {"allocations": [["a", one], ["b", one]], "at": 1.0}
    lean, library = _twins(make)
    trigger(lean, method, **fields)
    getattr(library, method)(**fields)
    ev_lean, ev_lib = lean.pending_events[-1], library.pending_events[-1]
    assert type(ev_lean) is type(ev_lib)
    assert list(vars(ev_lean)) == list(vars(ev_lib))  # same fields, same order
    assert _fields(ev_lean) == _fields(ev_lib)
    assert lean.version == library.version
    assert lean.modified_on == ev_lean.timestamp
    assert _state(lean) == _state(library)
    # and folding the lean event from scratch gives the same aggregate
    folded = None
    for e in lean.pending_events:
        folded = e.mutate(folded)
    assert _state(folded) == _state(lean)


def test_a_refused_body_records_nothing() -> None:
    acc = Account.open(tenant_id=TenantId("t"), now=0.0)
    acc.grant("g", 100, 0.0)
    before = (acc.version, len(acc.pending_events))
    with pytest.raises(AttributeError):  # no such method: the library's way, which refuses
        trigger(acc, "_no_such_event", at=1.0)
    node = Node.register(node_id=NodeId("n1"), pool_id=PoolId("p"), now=0.0,
                         capabilities=NodeCapabilities(allocatable=Resources(cpu_millis=1)))
    with pytest.raises(KeyError):  # the body fails: no version step, no pending event
        trigger(node, "_capacity_freed", lease_id="never", at=1.0)
    assert node.version == 1 and len(node.pending_events) == 1
    assert (acc.version, len(acc.pending_events)) == before


class _Custom(Aggregate):
    @event("Done")
    def done(self, value: int) -> None:
        self.value = value


def test_other_fields_or_events_it_cannot_match_go_the_library_s_way() -> None:
    agg = _Custom()
    trigger(agg, "done", value=3)  # equivalent: lean
    assert agg.value == 3 and agg.version == 2
    with pytest.raises(TypeError):  # a field the event lacks: the library refuses it
        trigger(agg, "done", value=4, extra=1)
    assert agg.version == 2
    lease = _lease()
    lease.reserve(3.0, node_id=NodeId("n1"), commit_timeout_seconds=60, hold_microcredits=0)
    assert lease.shape is lease.requested_shape  # the requested shape is reused, not re-parsed
    assert lease.node_id == "n1"


def test_the_lean_fold_gives_the_library_s_aggregate_and_refuses_what_it_refuses() -> None:
    from eventsourcing.domain import OriginatorVersionError

    from domain.fold import mutate

    lease = _lease()
    lease.reserve(3.0, node_id=NodeId("n1"), commit_timeout_seconds=60, hold_microcredits=5)
    lease.commit(4.0)
    lease.heartbeat(5.0, epoch=1, checkpoint_at=4.5)
    events = list(lease.pending_events)
    lean, library = events[0].mutate(None), events[0].mutate(None)
    for e in events[1:]:
        lean = mutate(e, lean)
        library = e.mutate(library)
    assert _state(lean) == _state(library) == _state(lease)
    with pytest.raises(OriginatorVersionError):
        mutate(events[1], lean)  # not the next event


def test_the_one_fold_steps_each_aggregate_by_its_next_event_only() -> None:
    from domain.fold import Fold

    lease = _lease()
    events = lease.collect_events()  # requested, queued
    fold = Fold()
    assert fold.step(events[1]) is None  # a later event of an aggregate it never saw
    first = fold.step(events[0])
    assert first is not None and first.version == 1
    again = fold.step(events[0])  # a version already folded: nothing changes
    assert again is None and fold.aggregates.get(lease.id) is first
    second = fold.step(events[1])
    assert second is not None and second.version == 2
    assert _state(second) == _state(lease)
