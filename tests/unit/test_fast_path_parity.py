"""The domain's half of the fast-path switch (POOL_FAST_PATHS): the same commands with the lean
trigger and fold on and off record the same events and fold into the same aggregates."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from eventsourcing.persistence import Mapper
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.transcoder import MsgspecTranscoder
from domain import Account, Lease, Node, NodeCapabilities, NodeId, PoolId, Resources
from domain.errors import DomainError
from domain.fold import Fold, lean_paths, use_lean_paths
from domain.policy.placement import NodeTable
from domain.resources import Shape, TenantId
from workers import fastpaths

VOLATILE = ("timestamp", "_created_on", "_modified_on", "_pending_events")
ONE = Resources(cpu_millis=1000, memory_mib=512)
OPS = ("request", "reserve", "commit", "heartbeat", "release", "hold", "settle", "allocate")


@pytest.fixture(autouse=True)
def _switch_restored() -> Iterator[None]:
    was = lean_paths()
    yield
    use_lean_paths(was)


def _plain(obj: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if k not in VOLATILE}


def _run(ops: list[tuple[str, int]], *, lean: bool) -> tuple[list[Any], list[Any], list[Any]]:
    """The outcome of each op (None, or the refusal's code), the aggregates, their events."""
    use_lean_paths(lean)
    now = 1_000.0
    node = Node.register(node_id=NodeId("n1"), pool_id=PoolId("p"), now=now,
                         capabilities=NodeCapabilities(
                             allocatable=Resources(cpu_millis=4000, memory_mib=4096)))
    account = Account.open(tenant_id=TenantId("t"), now=now)
    account.grant("initial", 10_000, now)
    leases: list[Lease] = []
    outcomes: list[Any] = []
    for op, i in ops:
        now += 1.0
        lease = leases[i % len(leases)] if leases else None
        try:
            if op == "request" or lease is None:
                leases.append(Lease.request(
                    tenant_id=TenantId("t"), pool_id=PoolId("p"),
                    idempotency_key=f"k{len(leases)}", maximum_runtime_seconds=600, now=now,
                    shape=Shape.build(cpu_millis=1000, memory_mib=512), queued=i % 2 == 0))
            elif op == "reserve":
                lease.reserve(now, node_id=NodeId("n1"), commit_timeout_seconds=60,
                              hold_microcredits=i)
            elif op == "commit":
                lease.commit(now)
            elif op == "heartbeat":
                lease.heartbeat(now, epoch=lease.epoch)
                node.heartbeat(now)
            elif op == "release":
                lease.release(now, exit_code=0 if lease.state == "running" else None)
            elif op == "hold":
                account.hold(f"h{i}", lease.id, 10 + i, now)
            elif op == "settle":
                account.settle(f"h{i}", lease.id, i, now)
            else:
                node.allocate_many([(lease.id, ONE)], now)
            outcomes.append(None)
        except DomainError as e:
            outcomes.append(e.code)
    aggregates: list[Any] = [node, account, *leases]
    events = [e for agg in aggregates for e in agg.pending_events]
    return outcomes, aggregates, events


def _whole(agg: Any) -> dict[str, Any]:
    """All of an aggregate's state, its times included (one log folded two ways has one set)."""
    return {k: v for k, v in vars(agg).items() if k != "_pending_events"}


def _event_view(event: Any) -> tuple[Any, ...]:
    return type(event), [k for k in vars(event)], _plain(event)


def _folded(events: list[Any], *, lean: bool) -> dict[Any, dict[str, Any]]:
    use_lean_paths(lean)
    fold = Fold()
    for event in events:
        assert fold.step(event) is not None
    return {k: _whole(v) for k, v in fold.aggregates.items()}  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 5)), min_size=1, max_size=30))
def test_the_same_commands_record_the_same_events_and_state_either_way(
        ops: list[tuple[str, int]]) -> None:
    fast_outcomes, fast_aggs, fast_events = _run(ops, lean=True)
    plain_outcomes, plain_aggs, plain_events = _run(ops, lean=False)
    assert fast_outcomes == plain_outcomes
    assert [_event_view(e) for e in fast_events] == [_event_view(e) for e in plain_events]
    assert [_plain(a) for a in fast_aggs] == [_plain(a) for a in plain_aggs]
    for agg in (*fast_aggs, *plain_aggs):  # the times differ run to run; where they go does not
        assert agg.modified_on == agg.pending_events[-1].timestamp
        assert agg.version == agg.pending_events[-1].originator_version
    # a log the fast path wrote folds the same through either path, and into what it decided
    stored = [_stored_and_back(e) for e in fast_events]
    by_plain, by_fast = _folded(stored, lean=False), _folded(stored, lean=True)
    assert by_plain == by_fast == {a.id: _whole(a) for a in fast_aggs}


_MAPPER: Mapper[Any] = Mapper(transcoder=MsgspecTranscoder())


def _stored_and_back(event: Any) -> Any:
    return _MAPPER.to_domain_event(_MAPPER.to_stored_event(event))


def test_the_switch_reaches_the_domain_and_refuses_a_value_it_does_not_know() -> None:
    was = fastpaths.ON
    try:
        assert fastpaths.configure({"POOL_FAST_PATHS": "off"}) is False
        assert lean_paths() is False and fastpaths.ON is False
        assert NodeTable().misses_remembered is False
        assert fastpaths.configure({"POOL_FAST_PATHS": "ON"}) is True and lean_paths()
        assert NodeTable().misses_remembered is True
        assert fastpaths.configure({}) is True  # unset: on
        with pytest.raises(fastpaths.FastPathsSettingError) as refused:
            fastpaths.configure({"POOL_FAST_PATHS": "fast"})
        assert refused.value.code == "invalid_fast_paths_setting"
    finally:
        fastpaths.configure({"POOL_FAST_PATHS": "on" if was else "off"})
