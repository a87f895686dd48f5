"""The lease lifecycle: every legal path, every refusal as a typed error, replay as a fold.

Time is a plain number passed in; no clock is read anywhere in these tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from eventsourcing.persistence import DatetimeAsISO, JSONTranscoder, Mapper, UUIDAsHex

from domain import (
    IllegalTransition,
    InvalidAmount,
    JobSpec,
    JobState,
    Lease,
    LeaseExpired,
    LeaseState,
    NodeId,
    NotDue,
    PoolId,
    RuntimeLimitExceeded,
    Shape,
    StaleEpoch,
    TenantId,
)

SHAPE = Shape.build(cpu_millis=2000, memory_mib=4096)
JOB = JobSpec(image="registry.example/train:1", command=("python", "train.py"),
              env=(("SEED", "1"),), checkpoint_interval_seconds=60)


def new_lease(**overrides: Any) -> Lease:
    args: dict[str, Any] = {
        "tenant_id": TenantId("acme"), "pool_id": PoolId("gpu"), "idempotency_key": "req-1",
        "shape": SHAPE, "maximum_runtime_seconds": 3600, "lease_seconds": 600,
        "heartbeat_timeout_seconds": 30, "now": 0.0,
    }
    args.update(overrides)
    return Lease.request(**args)


def running_lease(**overrides: Any) -> Lease:
    lease = new_lease(**overrides)
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=500)
    lease.commit(10, JOB)
    return lease


def state_of(agg: Any) -> dict[str, Any]:
    return {k: v for k, v in agg.__dict__.items() if k != "_pending_events"}


def replay(events: Sequence[Any]) -> Any:
    agg = None
    for e in events:
        agg = e.mutate(agg)
    return agg


def through_json(events: Sequence[Any]) -> list[Any]:
    """Store and load each event with the library's JSON transcoder and no custom types."""
    transcoder = JSONTranscoder()
    transcoder.register(UUIDAsHex())
    transcoder.register(DatetimeAsISO())
    mapper: Mapper[Any] = Mapper(transcoder=transcoder)
    return [mapper.to_domain_event(mapper.to_stored_event(e)) for e in events]


def names(lease: Lease) -> list[str]:
    return [type(e).__name__ for e in lease.pending_events]


# Identity ------------------------------------------------------------------------------------


def test_a_retried_request_gets_the_same_lease_id() -> None:
    assert new_lease().id == new_lease().id == Lease.create_id("acme", "req-1")
    assert new_lease().lease_id == str(Lease.create_id("acme", "req-1"))


def test_the_same_key_from_another_tenant_is_another_lease() -> None:
    assert new_lease(tenant_id=TenantId("other")).id != new_lease().id
    assert new_lease(idempotency_key="req-2").id != new_lease().id


# The happy path ------------------------------------------------------------------------------


def test_a_lease_walks_from_request_to_release_in_past_tense_events() -> None:
    lease = running_lease()
    lease.job_started(11, epoch=1)
    lease.heartbeat(20, epoch=1, checkpoint_at=19)
    lease.renew(30)
    lease.job_exited(40, epoch=1, exit_code=0)
    lease.release(41)

    assert names(lease) == [
        "LeaseRequested", "LeaseQueued", "LeaseReserved", "LeaseCommitted", "JobStarted",
        "HeartbeatRecorded", "LeaseRenewed", "JobExited", "LeaseReleased",
    ]
    assert lease.state is LeaseState.RELEASED
    assert lease.job is not None and lease.job.state is JobState.EXITED
    assert lease.job.exit_code == 0
    assert not lease.is_live and not lease.holds_capacity
    assert lease.runtime_seconds(now=1000) == 31


def test_replaying_stored_events_rebuilds_the_same_lease() -> None:
    lease = running_lease()
    lease.heartbeat(20, epoch=1, checkpoint_at=15)
    lease.notice_preemption(25, grace_seconds=10)
    lease.confirm_stopped(30)
    lease.reserve(31, node_id=NodeId("n2"), commit_timeout_seconds=30, hold_microcredits=7)
    lease.commit(32)
    events = list(lease.pending_events)

    rebuilt = replay(through_json(events))

    assert state_of(rebuilt) == state_of(lease)
    assert [e.originator_version for e in events] == list(range(1, len(events) + 1))


def test_a_reservation_records_the_shape_only_when_it_differs_from_the_request() -> None:
    same, other = new_lease(), new_lease()
    for lease in (same, other):
        lease.queue(1)
    same.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    gpu = Shape.build(cpu_millis=2000, memory_mib=4096, gpu_count=1, gpu_model="H100")
    other.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5,
                  shape=gpu)
    assert same.pending_events[-1].shape is None and same.shape == same.requested_shape
    assert other.pending_events[-1].shape == gpu.to_dict() and other.shape == gpu
    for lease in (same, other):
        assert state_of(replay(through_json(list(lease.pending_events)))) == state_of(lease)


def test_an_older_reservation_event_that_carries_the_requested_shape_still_folds() -> None:
    lease = new_lease()
    lease.queue(1)
    # as written before the shape was left out when unchanged: the dict, always
    lease._reserved(at=2.0, node_id="n1", shape=lease.requested_shape.to_dict(), epoch=1,
                    reservation_deadline=32.0, hold_microcredits=0)
    rebuilt = replay(through_json(list(lease.pending_events)))
    assert rebuilt.shape == lease.requested_shape and state_of(rebuilt) == state_of(lease)


def test_reserve_records_the_placement_and_a_new_epoch() -> None:
    lease = new_lease()
    lease.queue(1)
    epoch = lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30,
                          hold_microcredits=500, shape=Shape.build(cpu_millis=2000,
                                                                   memory_mib=4096,
                                                                   gpu_model=None))
    assert epoch == lease.epoch == 1
    assert lease.node_id == "n1"
    assert lease.reservation_deadline == 32
    assert lease.hold_microcredits == 500
    assert lease.holds_capacity and lease.is_live
    assert lease.resources == SHAPE.resources


# Renewal -------------------------------------------------------------------------------------


def test_a_lease_never_renews_past_its_maximum_runtime() -> None:
    lease = running_lease(lease_seconds=3000)  # committed at 10: deadline 3010, limit 3610
    clamped = lease.renew(3005, extend_seconds=700)
    assert clamped is True
    assert lease.deadline == 3610
    assert lease.pending_events[-1].clamped is True  # type: ignore[attr-defined]


def test_renewing_a_lease_already_at_its_runtime_limit_is_refused() -> None:
    lease = running_lease(lease_seconds=3000)
    lease.renew(3005, extend_seconds=700)
    with pytest.raises(RuntimeLimitExceeded) as raised:
        lease.renew(3550)
    assert raised.value.code == "maximum_runtime_exceeded"


def test_a_renewal_never_shortens_the_deadline() -> None:
    lease = running_lease()  # deadline 610
    assert lease.renew(20, extend_seconds=5) is False
    assert lease.deadline == 610


def test_a_renewal_after_the_deadline_is_too_late() -> None:
    lease = running_lease()
    with pytest.raises(LeaseExpired):
        lease.renew(610)


def test_the_initial_term_is_the_lease_seconds() -> None:
    lease = running_lease()
    assert lease.deadline == 610
    assert lease.runtime_limit_at == 3610


# Heartbeats and epochs -----------------------------------------------------------------------


def test_a_heartbeat_from_an_earlier_placement_is_fenced() -> None:
    lease = running_lease()
    lease.notice_preemption(20, grace_seconds=5, requeue=True)
    lease.confirm_stopped(22)
    lease.reserve(23, node_id=NodeId("n2"), commit_timeout_seconds=30, hold_microcredits=1)
    lease.commit(24)
    with pytest.raises(StaleEpoch) as raised:
        lease.heartbeat(25, epoch=1)
    assert raised.value.code == "stale_epoch"
    assert (raised.value.current, raised.value.given) == (2, 1)
    lease.heartbeat(25, epoch=2)
    assert lease.last_heartbeat_at == 25


def test_a_heartbeat_after_the_deadline_is_refused_as_expired() -> None:
    lease = running_lease()
    with pytest.raises(LeaseExpired) as raised:
        lease.heartbeat(610, epoch=1)
    assert raised.value.code == "lease_expired"


def test_a_checkpoint_reported_in_a_heartbeat_bounds_the_work_at_risk() -> None:
    lease = running_lease()
    assert lease.work_at_risk_seconds(now=70) == 60
    lease.heartbeat(70, epoch=1, checkpoint_at=65)
    assert lease.last_checkpoint_at == 65
    assert lease.work_at_risk_seconds(now=70) == 5


# Deadlines -----------------------------------------------------------------------------------


def test_an_uncommitted_reservation_is_voided_at_its_deadline() -> None:
    lease = new_lease()
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    assert lease.next_due_at() == 32
    assert lease.expiry_due(31) is None
    assert lease.expiry_due(32) == "commit_timeout"

    assert lease.expire(32) is LeaseState.VOIDED
    assert names(lease)[-1] == "ReservationVoided"
    assert not lease.holds_capacity and not lease.is_live


def test_voiding_a_reservation_before_its_deadline_is_not_due() -> None:
    lease = new_lease()
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    with pytest.raises(NotDue):
        lease.void_reservation(31)


def test_committing_after_the_reservation_deadline_is_refused() -> None:
    lease = new_lease()
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    with pytest.raises(LeaseExpired) as raised:
        lease.commit(32, JOB)
    assert raised.value.reason == "commit_timeout"
    lease.expire(40)
    with pytest.raises(LeaseExpired):
        lease.commit(41, JOB)


def test_an_expired_lease_keeps_its_capacity_until_reconciled() -> None:
    lease = running_lease()
    assert lease.expiry_due(610) == "deadline"
    lease.expire(615)
    assert (lease.state, lease.holds_capacity) == (LeaseState.EXPIRED, True)
    lease.begin_reconciliation(616)
    assert (lease.state, lease.holds_capacity) == (LeaseState.RECONCILING, True)
    assert lease.confirm_stopped(620) is LeaseState.RELEASED
    assert not lease.holds_capacity
    assert lease.end_reason == "deadline"
    # billing stops at the hard deadline, not when the timer happened to fire
    assert lease.runtime_seconds(now=9999) == 600
    assert lease.job is not None and lease.job.failure_reason == "lease_expired"


def test_a_lost_heartbeat_is_an_expiry_reason() -> None:
    lease = running_lease()  # committed at 10, heartbeat timeout 30
    assert lease.next_due_at() == 40
    assert lease.expiry_due(39) is None
    assert lease.expiry_due(40) == "heartbeat_lost"
    lease.heartbeat(39, epoch=1)
    assert lease.next_due_at() == 69
    assert lease.expire(70) is LeaseState.EXPIRED
    assert lease.expiry_reason == "heartbeat_lost"


def test_expiring_a_lease_that_is_not_due_is_refused() -> None:
    lease = running_lease()
    with pytest.raises(NotDue):
        lease.expire(20)
    with pytest.raises(NotDue):
        lease.expire(20, reason="deadline")
    assert lease.state is LeaseState.RUNNING


def test_a_lost_node_expires_its_leases_at_once() -> None:
    lease = running_lease()
    assert lease.expire(20, reason="node_lost") is LeaseState.EXPIRED
    assert lease.expiry_reason == "node_lost"


def test_verbs_on_an_expired_lease_answer_lease_expired() -> None:
    lease = running_lease()
    lease.expire(20, reason="node_lost")
    for attempt in (
        lambda: lease.heartbeat(21, epoch=1),
        lambda: lease.renew(21),
        lambda: lease.release(21, exit_code=0),
        lambda: lease.job_started(21, epoch=1),
        lambda: lease.cancel(21),
    ):
        with pytest.raises(LeaseExpired):
            attempt()


# Cancel and release --------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, 1, 2], ids=["requested", "queued", "reserved"])
def test_cancelling_before_it_runs_ends_the_lease_at_once(steps: int) -> None:
    lease = new_lease()
    if steps >= 1:
        lease.queue(1)
    if steps >= 2:
        lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    assert lease.cancel(3, reason="changed_mind") is True
    assert lease.state is LeaseState.CANCELLED
    # the end reason is one of a fixed vocabulary; the holder's words are kept beside it
    assert lease.end_reason == "cancelled" and lease.stop_reason == "changed_mind"
    assert names(lease)[-1] == "LeaseCancelled"


def test_cancelling_a_running_lease_goes_through_stopping() -> None:
    lease = running_lease()
    lease.cancel(20)
    assert lease.state is LeaseState.STOPPING
    assert lease.holds_capacity  # the container may still be running
    lease.heartbeat(21, epoch=1)  # the agent is still alive while it stops the job
    assert lease.confirm_stopped(22, epoch=1) is LeaseState.CANCELLED
    assert names(lease)[-3:] == ["StopRequested", "HeartbeatRecorded", "LeaseCancelled"]
    assert not lease.holds_capacity
    assert lease.job is not None and lease.job.failure_reason == "cancelled"


def test_repeating_a_cancel_changes_nothing() -> None:
    lease = running_lease()
    lease.cancel(20)
    before = len(lease.pending_events)
    assert lease.cancel(21) is False
    lease.confirm_stopped(22)
    assert lease.cancel(23) is False
    assert len(lease.pending_events) == before + 1


def test_releasing_with_an_active_job_needs_its_exit_code() -> None:
    lease = running_lease()
    with pytest.raises(IllegalTransition) as raised:
        lease.release(20)
    assert raised.value.reasons == ("job_active",)
    lease.release(20, exit_code=3, epoch=1)
    assert lease.exit_code == 3
    assert lease.job is not None and lease.job.state is JobState.EXITED


def test_a_lease_runs_successive_jobs_until_released() -> None:
    lease = running_lease()
    lease.job_started(11, epoch=1)
    lease.job_failed(12, epoch=1, reason="image_pull_failed")
    assert lease.run_job(13, JobSpec(image="registry.example/train:2")) == 2
    lease.job_started(14, epoch=1)
    lease.job_exited(15, epoch=1, exit_code=0)
    assert lease.run_job(16, JobSpec(image="registry.example/eval:1")) == 3
    lease.job_exited(17, epoch=1, exit_code=0)
    lease.release(18)
    assert lease.job is not None and lease.job.number == 3
    assert lease.state is LeaseState.RELEASED


def test_a_second_job_cannot_start_while_one_is_active() -> None:
    lease = running_lease()
    with pytest.raises(IllegalTransition) as raised:
        lease.run_job(11, JOB)
    assert raised.value.reasons == ("job_active",)


def test_job_reports_follow_the_jobs_own_states() -> None:
    lease = running_lease()
    lease.job_exited(11, epoch=1, exit_code=1)
    with pytest.raises(IllegalTransition):
        lease.job_started(12, epoch=1)
    with pytest.raises(StaleEpoch):
        lease.job_failed(12, epoch=0, reason="x")


# Preemption ----------------------------------------------------------------------------------


def test_preemption_with_requeue_puts_the_lease_back_in_the_queue() -> None:
    lease = running_lease()
    lease.job_started(11, epoch=1)
    grace = lease.notice_preemption(20, grace_seconds=15, requeue=True)
    assert grace == 35 and lease.state is LeaseState.PREEMPTING and lease.holds_capacity
    assert not lease.preemption_overdue(34) and lease.preemption_overdue(35)

    assert lease.confirm_stopped(30) is LeaseState.QUEUED
    assert names(lease)[-2:] == ["LeasePreempted", "LeaseRequeued"]
    assert lease.attempts == 2 and lease.node_id is None and not lease.holds_capacity

    assert lease.reserve(31, node_id=NodeId("n2"), commit_timeout_seconds=30,
                         hold_microcredits=1) == 2
    lease.commit(32)  # no new job: the interrupted one restarts
    assert lease.job is not None
    assert (lease.job.number, lease.job.attempts, lease.job.state) == (1, 2, JobState.STARTING)
    assert lease.started_at == 32 and lease.deadline == 632


def test_preemption_without_requeue_ends_the_lease() -> None:
    lease = running_lease()
    lease.notice_preemption(20, grace_seconds=15, requeue=False)
    assert lease.confirm_stopped(30) is LeaseState.PREEMPTED
    assert not lease.is_live
    assert lease.runtime_seconds(now=999) == 20
    lease.requeue(40)  # the scheduler may still decide to bring it back
    assert lease.state is LeaseState.QUEUED and lease.attempts == 2


def test_a_job_that_finishes_within_its_grace_period_is_released() -> None:
    lease = running_lease()
    lease.notice_preemption(20, grace_seconds=15)
    lease.release(25, exit_code=0, epoch=1)
    assert lease.state is LeaseState.RELEASED


def test_a_non_preemptible_lease_refuses_a_preemption_notice() -> None:
    lease = running_lease(preemptible=False)
    with pytest.raises(IllegalTransition) as raised:
        lease.notice_preemption(20, grace_seconds=5)
    assert raised.value.reasons == ("not_preemptible",)


def test_a_minimum_runtime_protects_a_new_lease_from_preemption() -> None:
    lease = running_lease()
    with pytest.raises(IllegalTransition) as raised:
        lease.notice_preemption(20, grace_seconds=5, min_runtime_seconds=60)
    assert raised.value.reasons == ("min_runtime_not_reached",)
    lease.notice_preemption(70, grace_seconds=5, min_runtime_seconds=60)


def test_cancelling_during_preemption_stops_without_requeue() -> None:
    lease = running_lease()
    lease.notice_preemption(20, grace_seconds=15, requeue=True)
    lease.cancel(21)
    assert lease.confirm_stopped(22) is LeaseState.CANCELLED


# Refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verb", "call"),
    [
        ("commit", lambda lease: lease.commit(5, JOB)),
        ("reserve", lambda lease: lease.reserve(5, node_id=NodeId("n"),
                                                commit_timeout_seconds=1, hold_microcredits=0)),
        ("heartbeat", lambda lease: lease.heartbeat(5, epoch=0)),
        ("renew", lambda lease: lease.renew(5)),
        ("release", lambda lease: lease.release(5, exit_code=0)),
        ("begin_reconciliation", lambda lease: lease.begin_reconciliation(5)),
        ("requeue", lambda lease: lease.requeue(5)),
        ("confirm_stopped", lambda lease: lease.confirm_stopped(5)),
        ("notice_preemption", lambda lease: lease.notice_preemption(5, grace_seconds=1)),
    ],
)
def test_an_illegal_transition_raises_a_typed_error_and_records_nothing(
    verb: str, call: Any
) -> None:
    lease = new_lease()
    before = state_of(lease)
    with pytest.raises(IllegalTransition) as raised:
        call(lease)
    assert raised.value.code == "illegal_transition"
    assert (raised.value.from_state, raised.value.verb) == ("requested", verb)
    assert raised.value.to_dict()["code"] == "illegal_transition"
    assert state_of(lease) == before and len(lease.pending_events) == 1


@pytest.mark.parametrize(
    "overrides",
    [{"maximum_runtime_seconds": 0}, {"lease_seconds": -1}, {"heartbeat_timeout_seconds": 1.5},
     {"shape": Shape.build(cpu_millis=-1)}],
)
def test_nonsense_durations_and_shapes_are_refused(overrides: dict[str, Any]) -> None:
    with pytest.raises(InvalidAmount) as raised:
        new_lease(**overrides)
    assert raised.value.code == "invalid_amount"


def test_a_rejected_request_ends_without_ever_holding_capacity() -> None:
    lease = new_lease()
    lease.queue(1)
    lease.reject(2, "quota_exceeded", ["gpu_count"])
    assert lease.state is LeaseState.REJECTED and lease.rejection_code == "quota_exceeded"
    with pytest.raises(IllegalTransition):
        lease.queue(3)


def test_a_lease_past_both_deadlines_may_expire_for_either_reason() -> None:
    lease = running_lease()
    assert lease.expiry_due(700) == "deadline"  # the hard deadline is named first
    assert lease.expire(700, reason="heartbeat_lost") is LeaseState.EXPIRED


# How a lease ends: one vocabulary of end reasons, agreeing with the exit code -----------------


def test_releasing_a_reservation_gives_it_back_with_its_own_end_reason() -> None:
    lease = new_lease()
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    lease.release(3)
    assert lease.state is LeaseState.RELEASED and not lease.holds_capacity
    assert lease.end_reason == "reservation_released" and lease.exit_code is None
    assert lease.run_ended_at is None and lease.runtime_seconds(3) == 0
    assert names(lease)[-1] == "LeaseReleased"


@pytest.mark.parametrize(("code", "reason"), [(0, "succeeded"), (3, "failed"), (137, "failed")])
def test_a_job_exit_ends_the_lease_succeeded_or_failed_by_its_code(code: int,
                                                                    reason: str) -> None:
    lease = running_lease()
    lease.job_started(11, epoch=1)
    lease.job_exited(20, epoch=1, exit_code=code)
    lease.release(20, code, epoch=1)
    assert (lease.end_reason, lease.exit_code) == (reason, code)


def test_a_job_that_could_not_run_ends_the_lease_failed() -> None:
    lease = running_lease()
    lease.job_failed(12, epoch=1, reason="image pull failed")
    lease.release(12, epoch=1)
    assert lease.end_reason == "failed" and lease.exit_code is None


def test_releasing_a_lease_without_a_job_says_released() -> None:
    lease = new_lease()
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    lease.commit(10)
    lease.release(20)
    assert lease.end_reason == "released"


def test_a_cancelled_job_s_exit_code_shows_on_the_lease() -> None:
    lease = running_lease()
    lease.job_started(11, epoch=1)
    lease.cancel(20, reason="no longer needed")
    lease.job_exited(21, epoch=1, exit_code=143)  # the agent's SIGTERM
    lease.confirm_stopped(21, epoch=1)
    assert (lease.end_reason, lease.exit_code) == ("cancelled", 143)
    assert lease.stop_reason == "no longer needed"


def test_a_drained_lease_ends_preempted_and_keeps_why() -> None:
    lease = running_lease()
    lease.notice_preemption(20, grace_seconds=5, requeue=False, reason="drain:maintenance")
    lease.confirm_stopped(22)
    assert lease.end_reason == "preempted" and lease.stop_reason == "drain:maintenance"


def test_an_old_log_s_completed_release_reads_as_succeeded_or_failed() -> None:
    for code, reason in ((0, "succeeded"), (2, "failed")):
        lease = running_lease()
        # what the log holds from before the vocabulary: reason "completed" whatever the code
        lease._released(at=20.0, exit_code=code, reason="completed")
        again = replay(through_json(lease.collect_events()))
        assert (again.end_reason, again.exit_code) == (reason, code)


def test_a_late_commit_names_the_commit_window_in_seconds() -> None:
    lease = new_lease()
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=5)
    with pytest.raises(LeaseExpired, match="30 s"):
        lease.commit(40)
