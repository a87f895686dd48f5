"""A token bucket: how many requests may come at once (its burst) and how fast the room for
them comes back (its rate). Pure: the caller keeps the bucket and passes `now`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    """Tokens up to `burst`, refilled at `rate_per_second`; a request takes one."""

    tokens: float
    at: float  # when `tokens` was last brought up to date

    @classmethod
    def full(cls, burst: int, now: float) -> TokenBucket:
        return cls(tokens=float(burst), at=float(now))

    def take(self, now: float, *, rate_per_second: float, burst: int) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one will be (nothing
        taken). The rate and burst are passed each time, so a changed setting applies at once."""
        if now > self.at:
            self.tokens = min(float(burst), self.tokens + (now - self.at) * rate_per_second)
            self.at = now
        self.tokens = min(self.tokens, float(burst))
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate_per_second if rate_per_second > 0 else float("inf")

    def give_back(self, burst: int) -> None:
        """Return a token taken for a request that was not answered after all (it is run
        again, and takes one again)."""
        self.tokens = min(float(burst), self.tokens + 1.0)
