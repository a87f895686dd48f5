"""The lease's fair-use rules alone: what a heartbeat or renewal that changes nothing records
(nothing), and when a queued lease has waited long enough. Time is a plain number."""

from __future__ import annotations

from typing import Any

import pytest

from domain import JobSpec, Lease, LeaseState, NodeId, PoolId, Shape, TenantId
from domain.errors import (
    InvalidAmount,
    PriorityClassNotAllowed,
    QueueLimitExceeded,
    RateLimited,
    UnknownPriorityClass,
    VoidedReservationLimit,
)
from domain.pool import Pool, TenantPolicy
from domain.poolconfig import PoolConfig
from domain.rate import TokenBucket
from workers.pending import LeaseMemory

SHAPE = Shape.build(cpu_millis=2000, memory_mib=4096)


def new_lease(**overrides: Any) -> Lease:
    args: dict[str, Any] = {
        "tenant_id": TenantId("acme"), "pool_id": PoolId("gpu"), "idempotency_key": "req-1",
        "shape": SHAPE, "maximum_runtime_seconds": 3600, "lease_seconds": 600,
        "heartbeat_timeout_seconds": 40, "now": 0.0, "queued": True,
    }
    args.update(overrides)
    return Lease.request(**args)


def running_lease(**overrides: Any) -> Lease:
    lease = new_lease(**overrides)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(10, JobSpec(image="x"))  # deadline 610, runtime limit 3610
    lease.collect_events()
    return lease


# Heartbeats ----------------------------------------------------------------------------------


def test_a_heartbeat_inside_a_quarter_timeout_records_nothing() -> None:
    lease = running_lease()
    assert lease.heartbeat(11, epoch=1) is True  # the placement's first
    assert len(lease.collect_events()) == 1
    for now in (12, 15, 20.9):
        assert lease.heartbeat(now, epoch=1) is False
    assert lease.last_heartbeat_at == 11 and not lease.collect_events()
    assert lease.heartbeat(21, epoch=1) is True  # a quarter of 40 s on
    assert lease.heartbeat(22, epoch=1, checkpoint_at=21.5) is True  # a new checkpoint is news
    assert [type(e).__name__ for e in lease.collect_events()] == ["HeartbeatRecorded"] * 2


def test_a_heartbeat_that_is_no_news_is_still_fenced() -> None:
    lease = running_lease()
    lease.heartbeat(11, epoch=1)
    with pytest.raises(Exception) as raised:
        lease.heartbeat(12, epoch=2)
    assert getattr(raised.value, "code", None) == "stale_epoch"


# Renewals ------------------------------------------------------------------------------------


def test_a_renewal_is_recorded_only_when_it_moves_the_deadline_a_step() -> None:
    lease = running_lease()  # deadline 610
    assert lease.renew(20, step_seconds=60) is False and lease.deadline == 610  # moves 10 s
    assert not lease.collect_events()
    lease.renew(70, step_seconds=60)  # moves 60 s
    assert lease.deadline == 670 and len(lease.collect_events()) == 1


def test_a_short_extension_still_lands_before_its_deadline() -> None:
    lease = running_lease()
    lease.renew(590, extend_seconds=30, step_seconds=60)  # 620: 10 s, half of 30 is 15
    assert lease.deadline == 610 and not lease.collect_events()
    lease.renew(600, extend_seconds=30, step_seconds=60)  # 630: 20 s past half the extension
    assert lease.deadline == 630


def test_a_renewal_to_the_runtime_limit_is_recorded_however_small() -> None:
    lease = running_lease(lease_seconds=3000)  # deadline 3010
    lease.renew(3005, extend_seconds=600, step_seconds=60)  # 3605
    assert lease.renew(3011, extend_seconds=600, step_seconds=60) is True  # clamped: 5 s
    assert lease.deadline == 3610 and len(lease.collect_events()) == 2


# The queue -----------------------------------------------------------------------------------


def test_a_queued_lease_is_due_when_it_has_waited_its_queue_timeout() -> None:
    lease = new_lease(now=100.0, queue_timeout_seconds=60)
    assert lease.next_due_at() == 160
    assert lease.expiry_due(159) is None and lease.expiry_due(160) == "queue_timeout"
    lease.reject(160, "queue_timeout", ["queue_timeout_seconds"])
    assert lease.state is LeaseState.REJECTED and lease.end_reason == "queue_timeout"
    assert new_lease().next_due_at() is None  # no timeout: waits for ever
    with pytest.raises(InvalidAmount):
        new_lease(queue_timeout_seconds=0)


def test_a_placed_lease_is_timed_by_its_reservation_not_its_queue() -> None:
    lease = new_lease(now=0.0, queue_timeout_seconds=60)
    lease.reserve(70, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=0)
    assert lease.next_due_at() == 100 and lease.expiry_due(90) is None


def test_a_compact_queued_lease_names_the_same_due_time() -> None:
    lease = new_lease(now=100.0, queue_timeout_seconds=60)
    memory = LeaseMemory()
    (event,) = lease.collect_events()
    record = memory.absorb(event)
    assert not isinstance(record, bool) and record.next_due_at() == 160
    rebuilt = memory.promote(lease.id)
    assert isinstance(rebuilt, Lease) and rebuilt.queue_timeout_seconds == 60


def test_the_pool_refuses_a_request_past_its_queue_cap_and_says_what_is_left() -> None:
    pool = Pool.create(pool_id=PoolId("gpu"), now=0.0, config=PoolConfig(max_queued_leases=10))
    pool.admit_queue("acme", 7, 3)
    with pytest.raises(QueueLimitExceeded) as raised:
        pool.admit_queue("acme", 8, 3)
    assert raised.value.code == "queue_limit_exceeded"
    assert raised.value.reasons == ("max_queued_leases",)
    assert "2 more may queue, this request asks for 3" in raised.value.message


# Priority classes ----------------------------------------------------------------------------


CLASSES = (("preemptible", 0), ("standard", 10), ("high", 20))


def test_a_tenant_may_use_the_pools_default_class_and_the_classes_granted_only() -> None:
    pool = Pool.create(pool_id=PoolId("gpu"), now=0.0, config=PoolConfig(
        priority_classes=CLASSES, default_priority_class="standard"))
    policy = TenantPolicy.set(pool_id=PoolId("gpu"), tenant_id=TenantId("acme"), now=0.0)
    for unset in (None, policy):  # no policy, or one that grants nothing: the default only
        pool.admit_priority_class("acme", "standard", unset)
        with pytest.raises(PriorityClassNotAllowed) as raised:
            pool.admit_priority_class("acme", "high", unset)
        assert raised.value.code == "priority_class_not_allowed"
        assert raised.value.reasons == ("high", "standard")
    policy.update(weight=1, quota=None, now=1.0, priority_classes=["high"])
    pool.admit_priority_class("acme", "high", policy)
    with pytest.raises(PriorityClassNotAllowed):
        pool.admit_priority_class("acme", "preemptible", policy)
    with pytest.raises(UnknownPriorityClass):  # a class the pool lacks is unknown first
        pool.admit_priority_class("acme", "gold", policy)
    # a policy recorded before grants existed replays as granting nothing
    old = TenantPolicy(pool_id="gpu", tenant_id="acme", weight=1, quota=None, set_at=0.0)
    assert pool.classes_allowed(old) == ("standard",)


# Request rate --------------------------------------------------------------------------------


def test_a_token_bucket_lets_a_burst_through_then_refills_at_its_rate_up_to_the_burst() -> None:
    pool = Pool.create(pool_id=PoolId("gpu"), now=0.0, config=PoolConfig(
        requests_per_second=10, request_burst=3))
    bucket = TokenBucket.full(3, now=0.0)
    for _ in range(3):
        pool.admit_request_rate("acme", bucket, 0.0)
    with pytest.raises(RateLimited) as raised:
        pool.admit_request_rate("acme", bucket, 0.05)  # half a token back
    assert raised.value.code == "rate_limited"
    assert raised.value.retry_after_seconds == pytest.approx(0.05)
    assert raised.value.details == {"requests_per_second": 10, "request_burst": 3,
                                    "retry_after_seconds": 1}
    pool.admit_request_rate("acme", bucket, 0.1)  # a whole one now
    for _ in range(3):  # an hour idle fills only the burst
        pool.admit_request_rate("acme", bucket, 3600.0)
    with pytest.raises(RateLimited):
        pool.admit_request_rate("acme", bucket, 3600.0)
    assert PoolConfig(requests_per_second=0, request_burst=0).problems() == [
        "requests_per_second must be positive", "request_burst must be positive"]


# Reservations that time out uncommitted -----------------------------------------------------


def test_a_tenant_past_its_voided_reservations_waits_out_the_window() -> None:
    pool = Pool.create(pool_id=PoolId("gpu"), now=0.0, config=PoolConfig(
        max_voided_reservations=3, voided_reservation_window_seconds=100))
    policy = TenantPolicy.set(pool_id=PoolId("gpu"), tenant_id=TenantId("acme"), now=0.0)
    for at in (10.0, 20.0, 30.0, 40.0):  # only the last three are kept
        assert pool.note_voided_reservation(policy, at)
    assert policy.voided_at == (20.0, 30.0, 40.0)
    pool.admit_after_voids("acme", None, 41.0)  # no policy: nothing remembered
    with pytest.raises(VoidedReservationLimit) as raised:
        pool.admit_after_voids("acme", policy, 41.0)
    assert raised.value.code == "voided_reservation_limit"
    assert raised.value.details == {"max_voided_reservations": 3,
                                    "voided_reservation_window_seconds": 100,
                                    "retry_after_seconds": 79}  # 20 leaves at 120
    assert "max_voided_reservations is 3" in raised.value.message
    with pytest.raises(VoidedReservationLimit):
        pool.admit_after_voids("acme", policy, 119.9)
    pool.admit_after_voids("acme", policy, 120.0)
    # a pool without the limit records nothing and refuses nothing
    free = Pool.create(pool_id=PoolId("free"), now=0.0, config=PoolConfig(
        max_voided_reservations=0))
    assert not free.note_voided_reservation(policy, 50.0)
    free.admit_after_voids("acme", policy, 50.0)
