"""What a lease does when an attempt ends badly: its retry policy and the pure decisions over
it (whether to run again, and when), from the times its events carry; no clock is read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from domain.errors import InvalidAmount

# the end reasons an attempt may be retried on (domain.lease END_REASONS' subset)
RETRY_REASONS: tuple[str, ...] = ("failed", "node_lost", "heartbeat_lost", "preempted",
                                  "deadline")
# the held reasons of a lease that waits out of the queue (LeaseState.HELD)
RETRY_BACKOFF = "retry_backoff"
DEFAULT_BACKOFF_MAX_SECONDS = 3600


@dataclass(frozen=True)
class RetryPolicy:
    """Run the lease again, up to `max_attempts` attempts in all, when an attempt ends with one
    of the reasons in `on`; the n-th retry waits `backoff_seconds * 2**(n-1)`, at most
    `backoff_max_seconds`, before it queues again."""

    max_attempts: int
    on: tuple[str, ...] = ("failed",)
    backoff_seconds: int = 0
    backoff_max_seconds: int = DEFAULT_BACKOFF_MAX_SECONDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "on", tuple(sorted(set(self.on))))
        if self.max_attempts < 1:
            raise InvalidAmount("max_attempts must be at least 1", reasons=("max_attempts",))
        unknown = [r for r in self.on if r not in RETRY_REASONS]
        if unknown:
            raise InvalidAmount(f"cannot retry on {unknown[0]!r}: one of "
                                f"{', '.join(RETRY_REASONS)}", reasons=("on",))
        if self.backoff_seconds < 0 or self.backoff_max_seconds < 0:
            raise InvalidAmount("backoff seconds must not be negative",
                                reasons=("backoff_seconds",))

    def to_dict(self) -> dict[str, Any]:
        return {"max_attempts": self.max_attempts, "on": list(self.on),
                "backoff_seconds": self.backoff_seconds,
                "backoff_max_seconds": self.backoff_max_seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RetryPolicy:
        return cls(max_attempts=int(d["max_attempts"]), on=tuple(d.get("on") or ("failed",)),
                   backoff_seconds=int(d.get("backoff_seconds") or 0),
                   backoff_max_seconds=int(d.get("backoff_max_seconds",
                                                 DEFAULT_BACKOFF_MAX_SECONDS)))

    def backoff(self, retry_number: int) -> float:
        """Seconds the `retry_number`-th retry (1, 2, …) waits before it queues again."""
        if self.backoff_seconds <= 0:
            return 0.0
        return float(min(self.backoff_seconds * 2 ** min(retry_number - 1, 32),
                         self.backoff_max_seconds))


@dataclass(frozen=True)
class RetryDecision:
    """Run attempt `attempt` next; it may queue from `queue_at` (the attempt's end when there is
    no backoff)."""

    attempt: int
    queue_at: float
    backoff_seconds: float = 0.0

    @property
    def held(self) -> bool:
        """Whether it waits out a backoff before it queues."""
        return self.backoff_seconds > 0


def next_attempt(policy: RetryPolicy | None, *, reason: str, attempt: int, retries_done: int,
                 ended_at: float) -> RetryDecision | None:
    """The retry an attempt ending at `ended_at` with `reason` earns: None when the lease ends
    instead (no policy, a reason not retried on, or `max_attempts` attempts ended)."""
    if policy is None or reason not in policy.on or retries_done + 1 >= policy.max_attempts:
        return None
    wait = policy.backoff(retries_done + 1)
    return RetryDecision(attempt=attempt + 1, queue_at=ended_at + wait, backoff_seconds=wait)
