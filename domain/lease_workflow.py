"""A lease's workflow: the retries of its attempts, the leases it waits for, the array it
is one of; recorded in one field of its request (`workflow`)."""

from __future__ import annotations

from domain.dependency import Dependency
from domain.errors import NotDue
from domain.lease_guards import LeaseGuards
from domain.lease_values import LeaseState
from domain.retry import RETRY_BACKOFF, RetryPolicy, next_attempt

S = LeaseState


class LeaseWorkflow(LeaseGuards):
    """Retries, dependencies and array throttles: what the request's `workflow` asks for."""

    @property
    def retry_policy(self) -> RetryPolicy | None:
        policy = (self.workflow or {}).get("retries")
        return None if not policy else RetryPolicy.from_dict(policy)

    @property
    def after(self) -> list[list[str]]:
        """The leases it waits for, as recorded: [[lease id, condition], …]."""
        return list((self.workflow or {}).get("after") or ())

    @property
    def dependencies(self) -> tuple[Dependency, ...]:
        return tuple(Dependency.from_value(v) for v in self.after)

    @property
    def array_id(self) -> str | None:
        value = (self.workflow or {}).get("array_id")
        return None if value is None else str(value)

    @property
    def max_running(self) -> int | None:
        value = (self.workflow or {}).get("max_running")
        return None if value is None else int(value)

    def queue_held(self, now: float) -> None:
        """A held lease joins the queue: its dependencies are met, or its backoff is over (its
        wait for capacity starts now)."""
        self._require("queue_held", {S.HELD})
        if self.held_until is not None and now < self.held_until:
            raise NotDue(f"its retry backoff lasts until {self.held_until}",
                         reasons=(RETRY_BACKOFF,))
        self._queued(at=float(now))

    def _retry(self, at: float, reason: str, exit_code: int | None) -> bool:
        """Run the lease again when its retry policy says an attempt ending so earns it
        (domain.retry.next_attempt): queued at once, or held through a backoff. Each attempt's
        end is kept; the next one avoids this node where another fits. False: it ends."""
        decision = next_attempt(self.retry_policy, reason=reason, attempt=self.attempts,
                                retries_done=len(self.attempt_ends), ended_at=at)
        if decision is None:
            return False
        self._retried(at=at, attempt=decision.attempt, reason=reason, exit_code=exit_code,
                      node_id=None if self.node_id is None else str(self.node_id),
                      held_until=decision.queue_at if decision.held else None)
        return True
