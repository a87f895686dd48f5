"""Retries, dependencies and array throttles in the lease aggregate: pure decisions on times
passed in, and a replay of the events gives the same lease."""

from __future__ import annotations

import pytest

from domain import InvalidAmount, JobSpec, Lease, LeaseState, NodeId, NotDue
from domain.dependency import Dependency, verdict
from domain.retry import RetryPolicy, next_attempt
from tests.unit.test_domain_lease import new_lease, replay, state_of

JOB = JobSpec(image="", command=("sh", "-c", "exit 1"))


def _run(lease: Lease, now: float, node: str = "n1") -> None:
    lease.reserve(now, node_id=NodeId(node), commit_timeout_seconds=30, hold_microcredits=0)
    if lease.restarts_on_placement or lease.job is not None:
        lease.commit(now + 1)
    else:
        lease.commit(now + 1, JOB)


def test_a_failed_attempt_is_retried_until_max_attempts() -> None:
    lease = new_lease(retries=RetryPolicy(max_attempts=3, on=("failed",)), queued=True)
    for attempt, now in ((1, 10.0), (2, 20.0)):
        _run(lease, now)
        assert lease.attempts == attempt
        lease.release(now + 5, exit_code=1)
        assert lease.state is LeaseState.QUEUED
    _run(lease, 30.0, node="n2")
    assert lease.attempts == 3 and lease.job is not None and lease.job.attempts == 3
    lease.release(35.0, exit_code=1)
    assert lease.state is LeaseState.RELEASED and lease.end_reason == "failed"
    assert [(a, r, n) for a, r, n, _c, _at in lease.attempt_ends] == [
        (1, "failed", "n1"), (2, "failed", "n1")]
    assert state_of(replay(lease.collect_events())) == state_of(lease)


def test_a_success_ends_the_lease_and_a_reason_not_retried_on_ends_it_too() -> None:
    lease = new_lease(retries=RetryPolicy(max_attempts=3, on=("failed",)), queued=True)
    _run(lease, 10.0)
    lease.release(12.0, exit_code=0)
    assert lease.state is LeaseState.RELEASED and lease.end_reason == "succeeded"
    lost = new_lease(retries=RetryPolicy(max_attempts=3, on=("failed",)), queued=True)
    _run(lost, 10.0)
    lost.expire(11.0, "node_lost")
    lost.confirm_stopped(12.0)
    assert lost.state is LeaseState.RELEASED and lost.end_reason == "node_lost"


def test_a_lost_node_is_retried_and_avoided_next_time() -> None:
    lease = new_lease(retries=RetryPolicy(max_attempts=2, on=("node_lost",)), queued=True)
    _run(lease, 10.0)
    lease.expire(11.0, "node_lost")
    lease.begin_reconciliation(11.0)
    lease.confirm_stopped(12.0)
    assert lease.state is LeaseState.QUEUED and lease.avoid_node == "n1"
    assert lease.restarts_on_placement


def test_a_backoff_holds_the_retry_until_its_time() -> None:
    lease = new_lease(retries=RetryPolicy(max_attempts=3, backoff_seconds=10,
                                          backoff_max_seconds=15), queued=True)
    _run(lease, 10.0)
    lease.release(20.0, exit_code=2)
    assert lease.state is LeaseState.HELD and lease.held_until == 30.0
    assert lease.next_due_at() == 30.0 and lease.expiry_due(29.0) is None
    with pytest.raises(NotDue):
        lease.queue_held(29.0)
    lease.queue_held(30.0)
    assert str(lease.state) == "queued" and lease.queued_at == 30.0
    _run(lease, 40.0)
    lease.release(41.0, exit_code=2)
    assert lease.held_until == 41.0 + 15  # 20 s doubled, capped at 15


def test_the_backoff_is_computed_from_the_times_given() -> None:
    policy = RetryPolicy(max_attempts=5, on=("failed", "deadline"), backoff_seconds=3)
    got = next_attempt(policy, reason="deadline", attempt=2, retries_done=1, ended_at=100.0)
    assert got is not None and got.attempt == 3 and got.queue_at == 106.0
    assert next_attempt(policy, reason="preempted", attempt=1, retries_done=0,
                        ended_at=0.0) is None
    assert next_attempt(policy, reason="failed", attempt=5, retries_done=4,
                        ended_at=0.0) is None
    with pytest.raises(InvalidAmount):
        RetryPolicy(max_attempts=2, on=("cancelled",))


def test_a_dependent_lease_is_held_then_queued_or_failed() -> None:
    dep = Dependency("a" * 8, "ok")
    lease = new_lease(after=(dep,), queued=True)
    assert lease.state is LeaseState.HELD and lease.held_reason == "waiting_for_dependency"
    assert lease.next_due_at() is None
    lease.queue_held(5.0)
    assert str(lease.state) == "queued" and lease.held_reason is None
    other = new_lease(after=(dep,), queued=True)
    other.reject(5.0, "dependency_failed", [dep.lease_id])
    assert other.state is LeaseState.REJECTED and other.end_reason == "dependency_failed"


def test_the_dependency_verdict() -> None:
    ok, notok, anyway = Dependency("a", "ok"), Dependency("b", "notok"), Dependency("c", "any")
    assert verdict([(ok, "succeeded"), (anyway, "failed")]) == ("satisfied", None)
    assert verdict([(ok, None), (notok, "failed")]) == ("waiting", "a")
    assert verdict([(ok, None), (notok, "succeeded")]) == ("failed", "b")
    with pytest.raises(InvalidAmount):
        Dependency("a", "maybe")
