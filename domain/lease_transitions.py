"""The verbs that move a lease through its lifecycle: admission, placement, ending and
preemption (states and verbs: docs/architecture.md#the-lease-lifecycle)."""

from __future__ import annotations

from domain.errors import IllegalTransition, InvalidAmount
from domain.errors import LeaseExpired as LeaseExpiredError
from domain.fold import trigger
from domain.jobspec import JobSpec
from domain.lease_guards import LeaseGuards, require_non_negative_int, require_positive_int
from domain.lease_jobs import job_outcome
from domain.lease_values import LeaseState
from domain.resources import NodeId, Shape

S = LeaseState


class LeaseTransitions(LeaseGuards):
    """From request to release: each verb checks the state, then records one event."""

    # Admission --------------------------------------------------------------------------------

    def queue(self, now: float) -> None:
        """Admit the request to the scheduler's queue."""
        self._require("queue", {S.REQUESTED})
        self._queued(at=float(now))

    def reject(self, now: float, code: str, reasons: list[str] | None = None) -> None:
        """Refuse the request before placement (quota, credits, unschedulable shape,
        `queue_timeout`: it waited its queue timeout, or `dependency_failed`)."""
        self._require("reject", {S.REQUESTED, S.QUEUED, S.HELD})
        self._rejected(at=float(now), code=code, reasons=list(reasons or []))

    # Placement --------------------------------------------------------------------------------

    def reserve(
        self,
        now: float,
        *,
        node_id: NodeId,
        commit_timeout_seconds: int,
        hold_microcredits: int,
        shape: Shape | None = None,
        devices: tuple[str, ...] = (),
    ) -> int:
        """Reserve capacity on a node until `now + commit_timeout_seconds`; returns the new
        epoch. `shape` is the placed shape (e.g. with the node's GPU model filled in);
        `devices` the node's GPU devices it gets (recorded with the reservation)."""
        self._require("reserve", {S.QUEUED})
        require_positive_int("commit_timeout_seconds", commit_timeout_seconds)
        require_non_negative_int("hold_microcredits", hold_microcredits)
        placed = self.requested_shape if shape is None else shape
        if not placed.resources.is_non_negative():
            raise InvalidAmount("a placed shape cannot hold negative resources")
        trigger(  # the scheduler's hot path: domain.fold' lean trigger, same event
            self, "_reserved",
            at=float(now),
            node_id=str(node_id),
            # recorded only when it differs from the requested shape (which the log has)
            shape=None if placed == self.requested_shape else placed.to_dict(),
            epoch=self.epoch + 1,
            reservation_deadline=float(now) + commit_timeout_seconds,
            hold_microcredits=hold_microcredits,
            devices=list(devices) if devices else None,
        )
        return self.epoch

    def commit(self, now: float, job: JobSpec | None = None) -> None:
        """Confirm the reservation and start the lease's term, optionally with its first job.

        Without a job, a job interrupted by preemption is restarted (attempts + 1)."""
        self._require("commit", {S.RESERVED})
        assert self.reservation_deadline is not None
        if now >= self.reservation_deadline:
            window = self.reservation_deadline - (self.reserved_at or self.reservation_deadline)
            raise LeaseExpiredError(
                "commit_timeout", message=f"the reservation was not committed within its "
                f"{window:g} s commit window, so it was given back"
            )
        term = min(self.lease_seconds, self.maximum_runtime_seconds)
        number, attempt, spec = self.jobs_submitted + 1, 1, job
        interrupted = self._job_to_restart() if job is None else None
        if interrupted is not None:
            number, attempt, spec = interrupted.number, interrupted.attempts + 1, interrupted.spec
        self._committed(
            at=float(now),
            deadline=float(now) + term,
            job_number=number if spec is not None else None,
            job_attempt=attempt if spec is not None else None,
            job_spec=spec.to_dict() if spec is not None else None,
        )

    # Ending -----------------------------------------------------------------------------------

    def release(
        self, now: float, exit_code: int | None = None, *, epoch: int | None = None
    ) -> None:
        """End the lease because its workload is over; capacity and hold can be returned.

        With an active job, `exit_code` is required (the agent saw the process exit): without
        it the workload may still be running, so use `cancel`, which stops it first. A
        reservation not yet committed is given back (`reservation_released`)."""
        self._require("release", {S.RESERVED, S.RUNNING, S.PREEMPTING})
        if epoch is not None:
            self._check_epoch(epoch)
        if self.state is S.RESERVED:
            self._released(at=float(now), exit_code=None, reason="reservation_released")
            return
        if self.job is not None and self.job.is_active and exit_code is None:
            raise IllegalTransition(self.state, "release", reasons=("job_active",),
                                    detail="the job is still active; cancel to stop it")
        outcome = job_outcome(exit_code, self.job)
        if not self._retry(float(now), outcome, exit_code):
            self._released(at=float(now), exit_code=exit_code, reason=outcome)

    def cancel(self, now: float, reason: str = "cancelled") -> bool:
        """Cancel the lease. Before it runs this ends it at once; a running lease first goes to
        `stopping` until the agent confirms. Repeating a cancel is a no-op (returns False)."""
        if self.state in (S.STOPPING, S.CANCELLED):
            return False
        self._require("cancel", {S.REQUESTED, S.HELD, S.QUEUED, S.RESERVED, S.RUNNING,
                                 S.PREEMPTING})
        if self.state in (S.RUNNING, S.PREEMPTING):
            self._stop_requested(at=float(now), reason=reason)
        else:
            self._cancelled(at=float(now), reason=reason)
        return True

    def confirm_stopped(self, now: float, *, epoch: int | None = None) -> LeaseState:
        """The workload is confirmed gone (by the agent, or the reconciler after a node loss).

        stopping → cancelled; preempting → preempted (then queued again when the notice asked
        for a requeue); expired | reconciling → released, or queued again for a gang member
        lost (its node or its heartbeats) whose gang asked to be requeued. Returns the new
        state."""
        self._require("confirm_stopped", {S.STOPPING, S.PREEMPTING, S.EXPIRED, S.RECONCILING})
        if epoch is not None:
            self._check_epoch(epoch)
        at = float(now)
        if self.state is S.STOPPING:
            self._cancelled(at=at, reason=self.stop_reason or "cancelled")
        elif self.state is S.PREEMPTING:
            if self.requeue_on_preemption or not self._retry(at, "preempted", None):
                self._preempted(at=at)
            if self.requeue_on_preemption:
                self._requeued(at=at, attempts=self.attempts + 1)
        elif (self.gang is not None and self.requeue_when_preempted
              and self.expiry_reason in ("node_lost", "heartbeat_lost")):
            # a gang that goes back in line goes whole: the member its node took with it too
            self._requeued(at=at, attempts=self.attempts + 1)
        elif not self._retry(at, self.expiry_reason or "expired", None):
            self._released(at=at, exit_code=None, reason=self.expiry_reason or "expired")
        return self.state

    # Preemption -------------------------------------------------------------------------------

    def notice_preemption(
        self,
        now: float,
        *,
        grace_seconds: int,
        requeue: bool = True,
        reason: str = "preempted",
        min_runtime_seconds: int = 0,
    ) -> float:
        """Tell a running lease it will be preempted; it has until the returned grace deadline
        to checkpoint and stop. Refused for non-preemptible leases and before
        `min_runtime_seconds` of this placement have passed."""
        self._require("notice_preemption", {S.RUNNING})
        require_non_negative_int("grace_seconds", grace_seconds)
        if not self.preemptible:
            raise IllegalTransition(self.state, "notice_preemption", reasons=("not_preemptible",))
        assert self.started_at is not None
        if now - self.started_at < min_runtime_seconds:
            raise IllegalTransition(self.state, "notice_preemption",
                                    reasons=("min_runtime_not_reached",))
        grace_deadline = float(now) + grace_seconds
        self._preemption_noticed(
            at=float(now), grace_deadline=grace_deadline, requeue=bool(requeue), reason=reason
        )
        return grace_deadline

    def requeue(self, now: float) -> None:
        """Put a preempted lease back in the queue (attempts + 1; the next reserve bumps the
        epoch, fencing reports from the old placement)."""
        self._require("requeue", {S.PREEMPTED})
        self._requeued(at=float(now), attempts=self.attempts + 1)

    def preemption_overdue(self, now: float) -> bool:
        """True when a preempting lease is past its grace deadline (time for a hard stop)."""
        return (
            self.state is S.PREEMPTING
            and self.grace_deadline is not None
            and now >= self.grace_deadline
        )
