"""A lease's id is what it always was, and a request stores the bytes that logs already hold."""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from eventsourcing.persistence import Mapper, StoredEvent

import domain.lease as lease_module
from bus.transcoder import MsgspecTranscoder
from domain import Lease, PoolId, Shape, TenantId
from domain.ids import pair_uuid

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
AT = datetime(2026, 12, 5, 15, 0, 0, 123456, tzinfo=UTC)
# a LeaseRequested as the removed direct creation (Lease._created, domain/creation.py) stored
# it, its bytes captured from that code before it went: logs hold events written this way
DIRECT_ID = uuid.UUID("3efc42b8-9bb1-5d7c-9f32-96dee7219dbc")
DIRECT_TOPIC = "domain.lease:Lease.LeaseRequested"
DIRECT_STATE = (
    b'{"timestamp":{"_type_":"datetime_iso","_data_":"2026-12-05T15:00:00.123456+00:00"},'
    b'"originator_topic":"domain.lease:Lease","tenant_id":"acme","idempotency_key":"req-1",'
    b'"pool_id":"gpu","shape":{"resources":{"cpu_millis":2000,"memory_mib":4096,'
    b'"gpu_count":0,"local_disk_gib":0,"extended":{}},"gpu_memory_gib_min":0,'
    b'"gpu_model":null,"cpu_arch":null,"gpu_partition":"none","network_egress":"none",'
    b'"bandwidth_mbps_min":0,"runtime":"container","region":null,"zone":null,'
    b'"preferences":[]},"maximum_runtime_seconds":3600,"lease_seconds":3600,'
    b'"heartbeat_timeout_seconds":30,"priority_class":"default","preemptible":true,'
    b'"requested_at":17.5,"trace_parent":null,"request_digest":'
    b'"abababababababababababababababababababababababababababababababab",'
    b'"checkpointable":false,"requeue_when_preempted":false,"advance_reservation_id":null,'
    b'"gang":null,"queued_at":17.5,"queue_timeout_seconds":null,"name":null,'
    b'"labels":{"team":"ml"},"workflow":null,"array":null}')


def test_a_lease_request_stores_what_the_direct_creation_stored_and_replays_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The request path once built the event and the aggregate without the library (a gain
    inside the machine's swing, removed: docs/performance-log.md). A log it wrote must still
    resolve and fold into the lease the library's creation makes now, byte for byte."""
    created: Any = Lease.LeaseRequested  # type: ignore[attr-defined]
    monkeypatch.setattr(created, "create_timestamp", classmethod(lambda cls: AT))
    lease = Lease.request(
        tenant_id=TenantId("acme"), pool_id=PoolId("gpu"), idempotency_key="req-1",
        shape=SHAPE, maximum_runtime_seconds=3600, now=17.5, queued=True,
        request_digest="ab" * 32, labels={"team": "ml"})
    mapper: Mapper[Any] = Mapper(transcoder=MsgspecTranscoder())
    stored = mapper.to_stored_event(lease.pending_events[0])
    assert (stored.originator_id, stored.originator_version, stored.topic, stored.state) == (
        DIRECT_ID, 1, DIRECT_TOPIC, DIRECT_STATE)
    old = StoredEvent(originator_id=DIRECT_ID, originator_version=1, topic=DIRECT_TOPIC,
                      state=DIRECT_STATE)
    replayed = mapper.to_domain_event(old).mutate(None)
    assert type(replayed) is Lease
    assert {k: v for k, v in vars(replayed).items() if k != "_pending_events"} == {
        k: v for k, v in vars(lease).items() if k != "_pending_events"}
