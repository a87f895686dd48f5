"""The lease's values: its states and the sets of them, the reasons it may end for, the jobs
it runs and the attempts it retried (no verbs; domain.lease holds the aggregate)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from domain.jobspec import JobSpec


class LeaseState(StrEnum):
    REQUESTED = "requested"
    HELD = "held"  # out of the queue until its dependencies are met or its backoff is over
    QUEUED = "queued"
    RESERVED = "reserved"
    RUNNING = "running"
    STOPPING = "stopping"
    PREEMPTING = "preempting"
    EXPIRED = "expired"
    RECONCILING = "reconciling"
    RELEASED = "released"
    CANCELLED = "cancelled"
    VOIDED = "voided"
    PREEMPTED = "preempted"
    REJECTED = "rejected"


S = LeaseState
TERMINAL_STATES: frozenset[LeaseState] = frozenset(
    {S.RELEASED, S.CANCELLED, S.VOIDED, S.PREEMPTED, S.REJECTED}
)
# Capacity is kept until the workload is confirmed gone: an expired lease's container may
# still be running on a partitioned-off node.
CAPACITY_HOLDING_STATES: frozenset[LeaseState] = frozenset(
    {S.RESERVED, S.RUNNING, S.STOPPING, S.PREEMPTING, S.EXPIRED, S.RECONCILING}
)
# States in which an agent may be running the workload and so may report on it.
WORKLOAD_STATES: frozenset[LeaseState] = frozenset({S.RUNNING, S.STOPPING, S.PREEMPTING})

EXPIRY_REASONS: tuple[str, ...] = ("commit_timeout", "heartbeat_lost", "deadline", "node_lost")
# How a lease ended (`end_reason`), besides the expiry reasons and a rejection's code:
# its job exited 0 / otherwise (or could not run); the holder released it without a job, or
# gave back a reservation it never committed; it was cancelled; it was preempted (or drained).
END_REASONS: tuple[str, ...] = ("succeeded", "failed", "released", "reservation_released",
                                "cancelled", "preempted", *EXPIRY_REASONS)


def queue_deadline(queued_at: float | None, queue_timeout_seconds: int | None) -> float | None:
    """When a lease queued at `queued_at` has waited `queue_timeout_seconds` (None: never)."""
    if queued_at is None or queue_timeout_seconds is None:
        return None
    return float(queued_at) + queue_timeout_seconds


class JobState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"
    FAILED = "failed"


@dataclass(frozen=True)
class Job:
    """One job run by a lease: its spec and how far it got. `attempts` counts restarts of the
    same job after the lease was preempted and requeued."""

    number: int
    spec: JobSpec
    submitted_at: float
    state: JobState = JobState.STARTING
    attempts: int = 1
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    failure_reason: str | None = None

    @property
    def is_active(self) -> bool:
        return self.state in (JobState.STARTING, JobState.RUNNING)


# One ended attempt of a lease that was retried: (attempt, end reason, node, exit code, at).
AttemptEnd = tuple[int, str, str | None, int | None, float]
