"""A request queued by its own event (one event a request) folds to what a request and its
LeaseQueued fold to, for every reader; logs of the two-event form stay readable."""

from __future__ import annotations

from typing import Any

from domain.lease import Lease, LeaseState
from domain.resources import NodeId, PoolId, Shape, TenantId
from projections.views.writer import Folder
from workers.pending import LeaseMemory, QueuedLease

NOW = 1_800_000_000.0
# what only the event's own position and time set: the version, and the aggregate's times
_OWN = {"_version", "_created_on", "_modified_on", "_pending_events"}


def _request(key: str, *, one_event: bool) -> list[Any]:
    lease = Lease.request(tenant_id=TenantId("alpha"), pool_id=PoolId("p1"),
                          idempotency_key=key, shape=Shape.build(cpu_millis=1000, memory_mib=512),
                          maximum_runtime_seconds=600, now=NOW, priority_class="standard",
                          request_digest="ab" * 32, queued=one_event)
    if not one_event:
        lease.queue(NOW)
    return list(lease.collect_events())


def _fold(events: list[Any]) -> Any:
    agg = None
    for e in events:
        agg = e.mutate(agg)
    return agg


def _state(lease: Any) -> dict[str, Any]:
    return {k: v for k, v in lease.__dict__.items() if k not in _OWN}


def test_one_event_folds_to_the_lease_a_request_and_its_queueing_fold_to() -> None:
    one, two = _request("k", one_event=True), _request("k", one_event=False)
    assert [type(e).__name__ for e in one] == ["LeaseRequested"]
    assert [type(e).__name__ for e in two] == ["LeaseRequested", "LeaseQueued"]
    a, b = _fold(one), _fold(two)
    assert a.state is b.state is LeaseState.QUEUED
    assert a.queued_at == b.queued_at == NOW
    assert _state(a) == _state(b)
    assert (a.version, b.version) == (1, 2)


def test_the_scheduler_memory_holds_both_forms_compactly_and_rebuilds_each_exactly() -> None:
    memory = LeaseMemory()
    one, two = _request("one", one_event=True), _request("two", one_event=False)
    record = memory.absorb(one[0])
    assert isinstance(record, QueuedLease) and record.version == 1
    assert memory.absorb(two[0]) is True and isinstance(memory.absorb(two[1]), QueuedLease)
    for events in (one, two):
        oid = events[0].originator_id
        assert memory.version_of(oid) == len(events)
        held = memory.peek(oid)
        assert isinstance(held, QueuedLease) and held.queued_at == NOW
        whole = memory.get(oid)
        assert type(whole) is Lease and whole.__dict__ == _fold(events).__dict__
        # examined and left waiting: compact again, and rebuilt the same once more
        assert memory.compact(whole) and memory.get(oid).__dict__ == _fold(events).__dict__


def test_a_lease_of_either_form_records_its_reservation_as_its_next_version() -> None:
    memory = LeaseMemory()
    for one_event in (True, False):
        events = _request(f"r-{one_event}", one_event=one_event)
        for e in events:
            memory.absorb(e)
        lease = memory.get(events[0].originator_id)
        lease.reserve(NOW + 1, node_id=NodeId("n1"), commit_timeout_seconds=30,
                      hold_microcredits=7)
        (reserved,) = lease.collect_events()
        assert reserved.originator_version == len(events) + 1
        assert lease.state is LeaseState.RESERVED


def test_the_views_fold_both_forms_to_a_queued_row() -> None:
    folder = Folder(app=None)
    for one_event in (True, False):
        agg = None
        for e in _request(f"v-{one_event}", one_event=one_event):
            agg = folder.apply(e)
        assert agg is not None and str(agg.state) == "queued" and agg.queued_at == NOW
