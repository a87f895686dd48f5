"""The operator's webhook settings: the key that seals endpoint secrets, the networks the
plane may POST to although they are not global, the per-tenant caps and the retry schedule."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from workers.webhooks.addresses import Network, networks
from workers.webhooks.signing import plane_key

ENV_KEY = "POOL_WEBHOOK_KEY"
ENV_ALLOW = "POOL_WEBHOOK_ALLOW"
ENV_MAX_ENDPOINTS = "POOL_WEBHOOK_MAX_ENDPOINTS"
ENV_MAX_IN_FLIGHT = "POOL_WEBHOOK_MAX_IN_FLIGHT"


@dataclass(frozen=True)
class WebhookSettings:
    """`key` None: webhooks are off (nothing can seal a secret). Retries wait
    `backoff_seconds` doubled each time, at most `backoff_max_seconds`, and stop
    `give_up_seconds` after the first try."""

    key: bytes | None = None
    allow: tuple[Network, ...] = ()
    max_endpoints: int = 10
    max_in_flight: int = 1000
    backoff_seconds: float = 5.0
    backoff_max_seconds: float = 3600.0
    give_up_seconds: float = 24 * 3600.0
    timeout_seconds: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WebhookSettings:
        key = env.get(ENV_KEY, "")
        return cls(key=plane_key(key) if key else None,
                   allow=networks(env.get(ENV_ALLOW, "")),
                   max_endpoints=int(env.get(ENV_MAX_ENDPOINTS, "") or 10),
                   max_in_flight=int(env.get(ENV_MAX_IN_FLIGHT, "") or 1000))

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after the `attempts`-th failed try."""
        return float(min(self.backoff_max_seconds,
                         self.backoff_seconds * 2 ** max(0, min(attempts - 1, 40))))
