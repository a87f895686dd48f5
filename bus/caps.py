"""What one tenant's or node's NATS user may hold at once (connections, subscriptions): the
caps the connection guard enforces and each tenant's and node's account carries as its limits
(ADR 023, 027, 028).
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
# what a node agent's user may hold. A real agent holds one connection, with two subscriptions
# (its inbox, its work queue's pull) and one more for each session open on it (at most 16 a
# lease): 8 connections leave room for a restarted agent's stale ones until the server's pings
# end them; 2,048 subscriptions for a connection at the server's per-connection cap (1,000) and
# a stale one of the same size
NODE_MAX_CONNECTIONS = 8
NODE_MAX_SUBSCRIPTIONS = 2048
NODE_CONNECTIONS_ENV = "POOL_NODE_MAX_CONNECTIONS"
NODE_SUBSCRIPTIONS_ENV = "POOL_NODE_MAX_SUBSCRIPTIONS"


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
        """A tenant's caps: POOL_TENANT_MAX_CONNECTIONS and POOL_TENANT_MAX_SUBSCRIPTIONS, or
        the defaults; InvalidLimit naming the variable for a value that is not a whole number
        of at least 1."""
        return cls._read(environ, (CONNECTIONS_ENV, MAX_CONNECTIONS),
                         (SUBSCRIPTIONS_ENV, MAX_SUBSCRIPTIONS))

    @classmethod
    def nodes_from_env(cls, environ: Mapping[str, str] | None = None) -> Caps:
        """A node agent's caps: POOL_NODE_MAX_CONNECTIONS and POOL_NODE_MAX_SUBSCRIPTIONS, or
        the defaults; InvalidLimit as `from_env`."""
        return cls._read(environ, (NODE_CONNECTIONS_ENV, NODE_MAX_CONNECTIONS),
                         (NODE_SUBSCRIPTIONS_ENV, NODE_MAX_SUBSCRIPTIONS))

    @classmethod
    def _read(cls, environ: Mapping[str, str] | None, *settings: tuple[str, int]) -> Caps:
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

        return cls(*(read(name, default) for name, default in settings))

    @classmethod
    def saved(cls, data: object, default: Caps) -> Caps:
        """Caps as `to_dict` saved them (auth.json), or `default` where there are none."""
        if not isinstance(data, dict):
            return default
        return cls(int(data["max_connections"]), int(data["max_subscriptions"]))

    def to_dict(self) -> dict[str, int]:
        """The caps by nats-server's names: an account's `limits`, and as auth.json keeps them."""
        return {"max_connections": self.max_connections,
                "max_subscriptions": self.max_subscriptions}

    def describe(self, kind: str = "tenant") -> str:
        """The caps and the settings that set them, for a `kind` ("tenant" or "node") user."""
        names = (CONNECTIONS_ENV, SUBSCRIPTIONS_ENV) if kind == "tenant" else (
            NODE_CONNECTIONS_ENV, NODE_SUBSCRIPTIONS_ENV)
        return (f"{self.max_connections} connections and {self.max_subscriptions} subscriptions "
                f"per {kind} user ({', '.join(names)})")
