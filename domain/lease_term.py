"""A lease's term and its timers: heartbeats, renewals, and the deadlines (commit, queue,
backoff, heartbeat, hard deadline) whose passing expires it, voids it or ends its wait."""

from __future__ import annotations

from domain.errors import IllegalTransition, NotDue, RuntimeLimitExceeded
from domain.lease_guards import LeaseGuards, require_positive_int
from domain.lease_values import EXPIRY_REASONS, WORKLOAD_STATES, LeaseState, queue_deadline
from domain.retry import RETRY_BACKOFF

S = LeaseState


class LeaseTerm(LeaseGuards):
    """The lease's clock, read from the times its events carry: `now` is always passed in."""

    # Deadlines --------------------------------------------------------------------------------

    @property
    def runtime_limit_at(self) -> float | None:
        """When the current placement reaches its maximum runtime; no renewal goes past it."""
        if self.started_at is None:
            return None
        return self.started_at + self.maximum_runtime_seconds

    @property
    def queue_deadline(self) -> float | None:
        """When a queued lease has waited its queue timeout (None: not queued, or no timeout)."""
        if self.state is not S.QUEUED or self.queue_timeout_seconds is None:
            return None
        return queue_deadline(self.queued_at, self.queue_timeout_seconds)

    def expiry_due(self, now: float) -> str | None:
        """The expiry reason that applies at `now`, or None: what the deadline timer checks.
        For a queued lease, `queue_timeout` once it has waited its queue timeout."""
        if self.state is S.QUEUED:
            due = self.queue_deadline
            return "queue_timeout" if due is not None and now >= due else None
        if self.state is S.HELD:
            until = self.held_until
            return RETRY_BACKOFF if until is not None and now >= until else None
        if self.state is S.RESERVED:
            assert self.reservation_deadline is not None
            return "commit_timeout" if now >= self.reservation_deadline else None
        if self.state in WORKLOAD_STATES:
            assert self.deadline is not None
            if now >= self.deadline:
                return "deadline"
            if now >= self._heartbeat_due_at():
                return "heartbeat_lost"
        return None

    def next_due_at(self) -> float | None:
        """The next instant at which `expiry_due` may become true: when to schedule the timer."""
        if self.state is S.QUEUED:
            return self.queue_deadline
        if self.state is S.HELD:
            return self.held_until  # a backoff's end; a dependency has no time
        if self.state is S.RESERVED:
            return self.reservation_deadline
        if self.state in WORKLOAD_STATES:
            assert self.deadline is not None
            return min(self.deadline, self._heartbeat_due_at())
        return None

    def work_at_risk_seconds(self, now: float) -> float:
        """Seconds of work a preemption would lose: time since the last checkpoint this run."""
        if self.started_at is None or self.state not in WORKLOAD_STATES:
            return 0.0
        since = max(self.started_at, self.last_checkpoint_at or self.started_at)
        return max(0.0, now - since)

    def runtime_seconds(self, now: float) -> float:
        """Billable seconds of the current (or last) placement: from commit to when it ended."""
        if self.started_at is None:
            return 0.0
        end = self.run_ended_at if self.run_ended_at is not None else now
        return max(0.0, end - self.started_at)

    def expire(self, now: float, reason: str | None = None) -> LeaseState:
        """Apply a due deadline. Without `reason`, the one `expiry_due(now)` names (NotDue if
        none). An uncommitted reservation is voided; a running lease becomes `expired` and
        keeps its capacity until reconciliation confirms it stopped. "node_lost" is accepted
        at any time; the timer reasons only when actually due. Returns the new state."""
        due = self.expiry_due(now)
        if self.state is S.RESERVED:
            if reason not in (None, "commit_timeout"):
                raise IllegalTransition(self.state, "expire", reasons=(str(reason),))
            self.void_reservation(now)
            return self.state
        self._require("expire", WORKLOAD_STATES)
        if reason is None:
            reason = due
        elif reason not in EXPIRY_REASONS or reason == "commit_timeout":
            raise IllegalTransition(self.state, "expire", reasons=(reason,),
                                    detail=f"unknown expiry reason {reason!r}")
        elif not self._is_due(reason, now):
            raise NotDue(f"{reason} is not due at {now}", reasons=(reason,))
        if reason is None:
            raise NotDue(f"nothing is due at {now}; next at {self.next_due_at()}")
        self._expired(at=float(now), reason=reason)
        return self.state

    def void_reservation(self, now: float) -> None:
        """Return an uncommitted reservation's capacity and hold once its deadline has passed."""
        self._require("void_reservation", {S.RESERVED})
        assert self.reservation_deadline is not None
        if now < self.reservation_deadline:
            raise NotDue(f"the reservation is open until {self.reservation_deadline}")
        self._voided(at=float(now), reason="commit_timeout")

    def begin_reconciliation(self, now: float) -> None:
        """The reconciler has asked the node to stop the expired workload and awaits proof."""
        self._require("begin_reconciliation", {S.EXPIRED})
        self._reconciliation_started(at=float(now))

    def _is_due(self, reason: str, now: float) -> bool:
        assert self.deadline is not None
        if reason == "deadline":
            return now >= self.deadline
        if reason == "heartbeat_lost":
            return now >= self._heartbeat_due_at()
        return reason == "node_lost"  # the reconciler's verdict; no timer to check

    def _heartbeat_due_at(self) -> float:
        assert self.started_at is not None
        seen = self.last_heartbeat_at if self.last_heartbeat_at is not None else self.started_at
        return seen + self.heartbeat_timeout_seconds

    # Term -------------------------------------------------------------------------------------

    def heartbeat(self, now: float, *, epoch: int, checkpoint_at: float | None = None) -> bool:
        """The agent is alive and the workload runs. A heartbeat from an earlier placement is
        fenced (StaleEpoch); one after the hard deadline is refused (LeaseExpired). A late
        heartbeat before the reconciler has acted is accepted: it proves the agent is alive.
        Returns whether it was recorded: one that is no news (`heartbeat_is_news`) changes
        nothing, so a flood of them costs the log nothing."""
        self._require("heartbeat", WORKLOAD_STATES)
        self._check_epoch(epoch)
        self._require_not_past_deadline(now)
        if not self.heartbeat_is_news(now, checkpoint_at):
            return False
        self._heartbeat_recorded(
            at=float(now),
            epoch=epoch,
            checkpoint_at=None if checkpoint_at is None else float(checkpoint_at),
        )
        return True

    def heartbeat_is_news(self, now: float, checkpoint_at: float | None = None) -> bool:
        """Whether a heartbeat at `now` is worth an event: the first of this placement, a new
        checkpoint, or a quarter of the heartbeat timeout since the last one recorded. Between
        those, a heartbeat changes no deadline that matters (the lease expires `timeout` after
        the last recorded one, so recording every quarter keeps it alive with margin)."""
        if self.last_heartbeat_at is None:
            return True
        if checkpoint_at is not None and checkpoint_at != self.last_checkpoint_at:
            return True
        return now - self.last_heartbeat_at >= self.heartbeat_timeout_seconds / 4

    def renew(self, now: float, extend_seconds: int | None = None, *,
              step_seconds: float = 0) -> bool:
        """Extend the deadline to `now + extend_seconds` (default: the lease term).

        Clamp-with-flag: a renewal that would pass `started_at + maximum_runtime_seconds` is cut
        to that limit and recorded with `clamped=True` (returned). Only when the deadline is
        already at the limit does renewal raise RuntimeLimitExceeded. It never shortens.

        Coalesced: it is recorded only when the deadline moves by at least `step_seconds` (the
        pool's renewal step), capped at half the extension so that a holder renewing within
        each extension always moves it in time; a move to the runtime limit is always
        recorded (there is no later one). A renewal that is not recorded changes nothing."""
        self._require("renew", {S.RUNNING})
        self._require_not_past_deadline(now)
        extend = self.lease_seconds if extend_seconds is None else extend_seconds
        require_positive_int("extend_seconds", extend)
        limit = self.runtime_limit_at
        assert limit is not None and self.deadline is not None
        if self.deadline >= limit:
            raise RuntimeLimitExceeded(
                f"the lease already ends at its maximum runtime of "
                f"{self.maximum_runtime_seconds}s",
                reasons=("maximum_runtime_exceeded",),
            )
        wanted = float(now) + extend
        deadline = max(self.deadline, min(wanted, limit))
        moved = deadline - self.deadline
        if moved <= 0 or (moved < min(step_seconds, extend / 2) and deadline < limit):
            return wanted > limit
        self._renewed(at=float(now), deadline=deadline, clamped=wanted > limit)
        return wanted > limit
