"""A lease is created on the request path without the library's generic machinery: the id, the
event, the aggregate and the stored bytes must be exactly what the library makes."""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from eventsourcing.persistence import Mapper

import domain.lease as lease_module
from bus.transcoder import MsgspecTranscoder
from domain import Lease, PoolId, Shape, TenantId
from domain.gang import GangMembership
from domain.ids import pair_uuid
from domain.policy.gang import GangSpec

NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:test")
AWKWARD = ['', 'a', '"', '\\', '\x00', '\x1f', '\x7f', ' ', 'é', '\u2028', '😀', '</', '["x", "y"]',
           'tenant-7', 'req#3', "it's", '\t\n']


def test_a_pair_id_is_uuid5_of_the_json_pair() -> None:
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(0x80)] + ['é', '\u2028', '😀']
    cases = [(a, b) for a in AWKWARD for b in AWKWARD]
    cases += [(''.join(rng.choices(alphabet, k=rng.randint(0, 8))),
               ''.join(rng.choices(alphabet, k=rng.randint(0, 8)))) for _ in range(5000)]
    for first, second in cases:
        want = uuid.uuid5(NAMESPACE, json.dumps([first, second]))
        got = pair_uuid(NAMESPACE, first, second)
        assert got == want and str(got) == str(want) and hash(got) == hash(want)
        assert (got.version, got.variant, got.is_safe) == (5, want.variant, want.is_safe)


def test_the_lease_id_is_what_it_always_was() -> None:
    for tenant in AWKWARD[1:]:
        for key in AWKWARD:
            assert Lease.create_id(tenant, key) == uuid.uuid5(
                lease_module._NAMESPACE, json.dumps([tenant, key]))


SHAPE = Shape.build(cpu_millis=2000, memory_mib=4096)
GANG = GangMembership.members("acme", "g-1", GangSpec.build(2))[1]
VARIANTS: list[dict[str, Any]] = [
    {},
    {"queued": True},
    {"queued": True, "trace_parent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
     "request_digest": "ab" * 32, "checkpointable": True, "requeue_when_preempted": True,
     "advance_reservation_id": "r-1", "gang": GANG, "priority_class": "high",
     "preemptible": False, "lease_seconds": 60},
    {"tenant_id": TenantId("é😀"), "idempotency_key": 'k"\\'},
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_a_lease_made_directly_is_the_library_s_lease(
        overrides: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    at = datetime(2026, 12, 5, 15, 0, 0, 123456, tzinfo=UTC)
    created: Any = Lease.LeaseRequested  # type: ignore[attr-defined]
    monkeypatch.setattr(created, "create_timestamp", classmethod(lambda cls: at))
    args: dict[str, Any] = {
        "tenant_id": TenantId("acme"), "pool_id": PoolId("gpu"), "idempotency_key": "req-1",
        "shape": SHAPE, "maximum_runtime_seconds": 3600, "now": 17.5, **overrides}
    assert lease_module._LEAN_CREATE is not None  # else the direct path is never taken
    direct = Lease.request(**args)
    monkeypatch.setattr(lease_module, "_LEAN_CREATE", None)
    library = Lease.request(**args)

    assert type(direct) is type(library) is Lease
    mine, theirs = direct.pending_events, library.pending_events
    assert [type(e) for e in mine] == [type(e) for e in theirs] == [created]
    assert list(vars(mine[0]).items()) == list(vars(theirs[0]).items())
    state = {k: v for k, v in vars(direct).items() if k != "_pending_events"}
    assert list(state.items()) == [
        (k, v) for k, v in vars(library).items() if k != "_pending_events"]

    mapper: Mapper[Any] = Mapper(transcoder=MsgspecTranscoder())
    stored, want = mapper.to_stored_event(mine[0]), mapper.to_stored_event(theirs[0])
    assert (stored.originator_id, stored.originator_version, stored.topic, stored.state) == (
        want.originator_id, want.originator_version, want.topic, want.state)
    replayed = mapper.to_domain_event(stored).mutate(None)
    assert {k: v for k, v in vars(replayed).items() if k != "_pending_events"} == state
