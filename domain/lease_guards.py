"""What every lease verb checks first: its state, its placement's epoch, its deadline, its
numbers; the base of the verb mixins that domain.lease.Lease is made of."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from domain.errors import IllegalTransition, InvalidAmount, StaleEpoch
from domain.errors import LeaseExpired as LeaseExpiredError
from domain.lease_values import LeaseState

if TYPE_CHECKING:
    from eventsourcing.domain import Aggregate

    from domain.gang import GangMembership
    from domain.lease_values import AttemptEnd, Job
    from domain.resources import NodeId, Shape

    _Verbs = Aggregate  # the verbs run on a Lease, an Aggregate (domain.fold.trigger takes one)
else:
    _Verbs = object

S = LeaseState

# Verbs a tenant or agent may use on a live lease; on an expired lease they are answered with
# LeaseExpired (so the agent knows to stop) rather than a bare IllegalTransition.
_EXPIRY_AWARE_VERBS = frozenset(
    {"commit", "heartbeat", "renew", "release", "run_job", "job_started", "job_exited",
     "job_failed", "cancel", "notice_preemption", "open_session"}
)


class LeaseGuards(_Verbs):
    """The guards of the lease's verbs. The state they read and the events they record are
    the aggregate's (domain.lease.Lease): declared here for the type checker only."""

    if TYPE_CHECKING:
        # the recorded state the verbs read (domain.lease.Lease.__init__ and its events)
        state: LeaseState
        epoch: int
        attempts: int
        attempt_ends: tuple[AttemptEnd, ...]
        workflow: dict[str, Any] | None
        gang: GangMembership | None
        preemptible: bool
        requeue_when_preempted: bool
        requeue_on_preemption: bool
        retrying: bool
        requested_shape: Shape
        node_id: NodeId | None
        lease_seconds: int
        maximum_runtime_seconds: int
        heartbeat_timeout_seconds: int
        queued_at: float | None
        queue_timeout_seconds: int | None
        held_until: float | None
        reserved_at: float | None
        reservation_deadline: float | None
        started_at: float | None
        deadline: float | None
        last_heartbeat_at: float | None
        last_checkpoint_at: float | None
        run_ended_at: float | None
        grace_deadline: float | None
        job: Job | None
        jobs_submitted: int
        interrupted_job: int | None
        expiry_reason: str | None
        stop_reason: str | None
        session_window_at: float | None
        sessions_in_window: int

        # the events they record (Lease's @event methods), and what one mixin asks of another
        def _queued(self, at: float) -> None: ...
        def _rejected(self, at: float, code: str, reasons: list[str]) -> None: ...
        def _committed(self, at: float, deadline: float, job_number: int | None,
                       job_attempt: int | None, job_spec: dict[str, Any] | None) -> None: ...
        def _job_submitted(self, at: float, job_number: int, spec: dict[str, Any]) -> None: ...
        def _job_started(self, at: float, epoch: int) -> None: ...
        def _job_exited(self, at: float, epoch: int, exit_code: int) -> None: ...
        def _job_failed(self, at: float, epoch: int, reason: str) -> None: ...
        def _heartbeat_recorded(self, at: float, epoch: int,
                                checkpoint_at: float | None) -> None: ...
        def _session_opened(self, at: float, session_id: str, kind: str, command: list[str],
                            tty: bool, port: int | None, rows: int | None, cols: int | None,
                            epoch: int) -> None: ...
        def _renewed(self, at: float, deadline: float, clamped: bool) -> None: ...
        def _released(self, at: float, exit_code: int | None, reason: str) -> None: ...
        def _stop_requested(self, at: float, reason: str) -> None: ...
        def _cancelled(self, at: float, reason: str) -> None: ...
        def _expired(self, at: float, reason: str) -> None: ...
        def _reconciliation_started(self, at: float) -> None: ...
        def _voided(self, at: float, reason: str) -> None: ...
        def _preemption_noticed(self, at: float, grace_deadline: float, requeue: bool,
                                reason: str) -> None: ...
        def _preempted(self, at: float) -> None: ...
        def _requeued(self, at: float, attempts: int) -> None: ...
        def _retried(self, at: float, attempt: int, reason: str, exit_code: int | None,
                     node_id: str | None, held_until: float | None) -> None: ...
        def _job_to_restart(self) -> Job | None: ...
        def _retry(self, at: float, reason: str, exit_code: int | None) -> bool: ...

    def _require(self, verb: str, allowed: set[LeaseState] | frozenset[LeaseState]) -> None:
        if self.state in allowed:
            return
        if verb in _EXPIRY_AWARE_VERBS:
            if self.state in (S.EXPIRED, S.RECONCILING):
                raise LeaseExpiredError(self.expiry_reason or "expired")
            if self.state is S.VOIDED:
                raise LeaseExpiredError("commit_timeout")
        raise IllegalTransition(self.state, verb)

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise StaleEpoch(current=self.epoch, given=epoch)

    def _require_not_past_deadline(self, now: float) -> None:
        if self.deadline is not None and now >= self.deadline:
            raise LeaseExpiredError("deadline")


def require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidAmount(f"{name} must be a positive integer, got {value!r}", reasons=(name,))


def require_non_negative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidAmount(
            f"{name} must be a non-negative integer, got {value!r}", reasons=(name,)
        )
