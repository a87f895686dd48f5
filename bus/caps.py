"""What one tenant's NATS user may hold at once (connections, subscriptions): the caps the
connection guard enforces and each tenant's account carries as its limits (ADR 023, 026).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from bus.errors import BusError

# what a tenant's user may hold, all its connections together (docs/security.md's limits)
MAX_CONNECTIONS = 64
MAX_SUBSCRIPTIONS = 4096
CONNECTIONS_ENV = "POOL_TENANT_MAX_CONNECTIONS"
SUBSCRIPTIONS_ENV = "POOL_TENANT_MAX_SUBSCRIPTIONS"


class InvalidLimit(BusError, ValueError):
    """A connection or subscription cap that is not a whole number of at least 1."""

    code = "invalid_limit"


@dataclass(frozen=True)
class Caps:
    """What one user may hold at once, over all its connections to the servers."""

    max_connections: int = MAX_CONNECTIONS
    max_subscriptions: int = MAX_SUBSCRIPTIONS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Caps:
        """POOL_TENANT_MAX_CONNECTIONS and POOL_TENANT_MAX_SUBSCRIPTIONS, or the defaults."""
        env = os.environ if environ is None else environ

        def read(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                value = 0
            if value < 1:
                raise InvalidLimit(f"{name}={raw!r}: a whole number of at least 1 is needed")
            return value

        return cls(read(CONNECTIONS_ENV, MAX_CONNECTIONS), read(SUBSCRIPTIONS_ENV, MAX_SUBSCRIPTIONS))

    def describe(self) -> str:
        return (f"{self.max_connections} connections and {self.max_subscriptions} subscriptions "
                f"per tenant user ({CONNECTIONS_ENV}, {SUBSCRIPTIONS_ENV})")
