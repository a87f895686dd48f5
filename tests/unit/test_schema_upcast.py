"""Versioning: stored v1 events upcast through eventsourcing's Mapper; wire bodies by version.

A v1 writer's bytes are built by hand (no class_version, no new field), exactly as they sit in
the log, so the test does not depend on the current class being able to write v1.
"""

from __future__ import annotations

import json
from typing import Annotated, Any
from uuid import uuid4

import msgspec
import pytest
from eventsourcing.domain import Aggregate, Snapshot
from eventsourcing.persistence import (
    DatetimeAsISO,
    JSONTranscoder,
    Mapper,
    StoredEvent,
    UUIDAsHex,
)
from eventsourcing.utils import get_topic

from schemas import LeaseRequest, PoolConfig, SchemaError, decode_command
from schemas.codec import CommandSpec, decode_with
from schemas.evolution import PoolPolicy


@pytest.fixture()
def mapper() -> Mapper[Any]:
    transcoder = JSONTranscoder()
    transcoder.register(UUIDAsHex())
    transcoder.register(DatetimeAsISO())
    return Mapper(transcoder=transcoder)


def v1_stored_policy_set(pool_uuid: Any, version: int) -> StoredEvent:
    """What a v1 writer stored: no `aging_seconds_per_rank`, no `class_version` key."""
    state = {
        "timestamp": {"_type_": "datetime_iso", "_data_": "2024-05-01T12:00:00+00:00"},
        "packing": "spread",
        "commit_timeout_seconds": 45,
    }
    return StoredEvent(
        originator_id=pool_uuid,
        originator_version=version,
        topic=get_topic(PoolPolicy.PolicySet),
        state=json.dumps(state).encode(),
    )


# -- stored events (eventsourcing) -------------------------------------------------------------


def test_v1_stored_event_decodes_as_v2_with_the_upcast_default(mapper: Mapper[Any]) -> None:
    assert PoolPolicy.PolicySet.class_version == 2
    event = mapper.to_domain_event(v1_stored_policy_set(uuid4(), 2))
    assert isinstance(event, PoolPolicy.PolicySet)
    assert event.packing == "spread" and event.commit_timeout_seconds == 45
    assert event.aging_seconds_per_rank == 0  # the v1 -> v2 default


def test_v2_events_store_their_class_version_and_round_trip(mapper: Mapper[Any]) -> None:
    policy = PoolPolicy("gpu-global")
    policy.set_policy(PoolConfig(pool_id="gpu-global", packing="spread", aging_seconds_per_rank=60))
    _created, policy_set = policy.collect_events()
    stored = mapper.to_stored_event(policy_set)
    assert json.loads(stored.state)["class_version"] == 2
    again = mapper.to_domain_event(stored)
    assert again.aging_seconds_per_rank == 60  # type: ignore[attr-defined]
    # A v2 event is not upcast again: the stored value survives.
    assert vars(again) == vars(policy_set)


def test_aggregate_replays_mixed_v1_and_v2_history(mapper: Mapper[Any]) -> None:
    policy = PoolPolicy("gpu-global")
    created = mapper.to_stored_event(policy.collect_events()[0])
    old = v1_stored_policy_set(created.originator_id, 2)
    events = [mapper.to_domain_event(s) for s in (created, old)]
    replayed: Aggregate | None = None
    for e in events:
        replayed = e.mutate(replayed)  # type: ignore[attr-defined]
    assert isinstance(replayed, PoolPolicy)
    assert replayed.packing == "spread" and replayed.aging_seconds_per_rank == 0
    assert replayed.version == 2


def test_v1_snapshot_upcasts_through_the_aggregate_class_version(mapper: Mapper[Any]) -> None:
    policy = PoolPolicy("gpu-global")
    policy.collect_events()
    snapshot = Snapshot.take(policy)
    state = dict(snapshot.state)
    state.pop("class_version")  # as a v1 writer took it: no version, no new attribute
    state.pop("aging_seconds_per_rank")
    v1_snapshot = Snapshot(
        originator_id=snapshot.originator_id,
        originator_version=snapshot.originator_version,
        timestamp=snapshot.timestamp,
        topic=snapshot.topic,
        state=state,
    )
    stored = mapper.to_stored_event(v1_snapshot)
    restored = mapper.to_domain_event(stored).mutate(None)  # type: ignore[attr-defined]
    assert isinstance(restored, PoolPolicy)
    assert restored.aging_seconds_per_rank == 0 and restored.pool_id == "gpu-global"


# -- wire bodies (msgspec) ---------------------------------------------------------------------

V1_BODY: dict[str, Any] = {
    "pool_id": "gpu-global",
    "shape": {"cpu_millis": 8000, "memory_mib": 32768, "gpu_count": 1},
    "maximum_runtime_seconds": 3600,
    "idempotency_key": "k-1",
}


@pytest.mark.parametrize("explicit", [True, False])
def test_v1_lease_request_decodes_into_the_current_struct(explicit: bool) -> None:
    body = dict(V1_BODY, schema_version=1) if explicit else V1_BODY
    req = decode_command("lease.request", json.dumps(body).encode())
    assert isinstance(req, LeaseRequest) and req.schema_version == 1


def test_newer_lease_request_is_refused_until_v2_exists() -> None:
    # v2 may rename fields; refusing on the version first beats a misleading "unknown field".
    body = dict(V1_BODY, schema_version=2, pool="renamed-in-v2")
    with pytest.raises(SchemaError) as info:
        decode_command("lease.request", json.dumps(body).encode())
    assert info.value.code == "unsupported_schema_version"
    assert info.value.path == "$.schema_version"


def test_newer_nested_shape_is_refused_as_unsupported_version() -> None:
    body = dict(V1_BODY, shape=dict(V1_BODY["shape"], schema_version=2))
    with pytest.raises(SchemaError) as info:
        decode_command("lease.request", json.dumps(body).encode())
    assert info.value.code == "unsupported_schema_version"
    assert info.value.path == "$.shape.schema_version"


@pytest.mark.parametrize("version", [0, -1, "1", True, 1.0, None])
def test_nonsense_schema_versions_are_invalid_fields(version: Any) -> None:
    with pytest.raises(SchemaError) as info:
        decode_command("lease.request", json.dumps(dict(V1_BODY, schema_version=version)).encode())
    assert info.value.code == "invalid_field"
    assert info.value.path == "$.schema_version"


# A worked v2 of a small command, to show the wire upcast chain the decoder already runs:
# v2 adds a required `reason`; v1 bodies get "unspecified" from the upcaster.
class RenewLeaseV2(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """RenewLease as it would be in v2 (test-only)."""

    schema_version: Annotated[int, msgspec.Meta(ge=1, le=2)] = 2
    extend_seconds: Annotated[int, msgspec.Meta(ge=1, le=30 * 86400)]
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


def renew_v1_to_v2(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "reason": "unspecified"}


RENEW_V2 = CommandSpec(RenewLeaseV2, version=2, upcasters={1: renew_v1_to_v2})


def test_wire_upcast_v1_body_to_v2_struct() -> None:
    out = decode_with(RENEW_V2, b'{"schema_version": 1, "extend_seconds": 600}')
    assert out == RenewLeaseV2(extend_seconds=600, reason="unspecified")
    # No schema_version at all means v1, the version before the field existed.
    assert decode_with(RENEW_V2, b'{"extend_seconds": 600}') == out


def test_wire_v2_body_decodes_directly_and_v3_is_refused() -> None:
    out = decode_with(RENEW_V2, b'{"schema_version": 2, "extend_seconds": 5, "reason": "slow"}')
    assert out == RenewLeaseV2(extend_seconds=5, reason="slow")
    with pytest.raises(SchemaError) as info:
        decode_with(RENEW_V2, b'{"schema_version": 3, "extend_seconds": 5, "reason": "x"}')
    assert info.value.code == "unsupported_schema_version"


def test_wire_upcast_result_is_still_validated() -> None:
    # The upcast body goes through the v2 constraints: a bad v1 value is still refused.
    with pytest.raises(SchemaError) as info:
        decode_with(RENEW_V2, b'{"schema_version": 1, "extend_seconds": 0}')
    assert info.value.code == "invalid_field" and info.value.path == "$.extend_seconds"


def test_wire_version_without_an_upcaster_is_unsupported() -> None:
    no_chain = CommandSpec(RenewLeaseV2, version=2)
    with pytest.raises(SchemaError) as info:
        decode_with(no_chain, b'{"schema_version": 1, "extend_seconds": 5}')
    assert info.value.code == "unsupported_schema_version"
