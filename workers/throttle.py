"""Each tenant's token bucket for all its commands and reads, kept by one command-service
process: a tenant past it is refused `rate_limited` before its command is decoded.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable

from domain.rate import TokenBucket

# per tenant per process, whatever the verb (docs/adr/022): twice a pool's default
# lease-request rate (200/s), and under what one closed-loop client sends, so a single
# flooding client is held to it; the burst covers a full request burst (1,000) and more
COMMANDS_PER_SECOND = 400
COMMAND_BURST = 2000
PREFIX = "pool.cmd."


class TenantThrottle:
    """The service lanes' gate (bus.service.Gate) for tenants' subjects `pool.cmd.<tenant>.…`:
    None to go on, or the tenant and its refusal. Called on the services' one loop only."""

    def __init__(self, per_second: int = COMMANDS_PER_SECOND, burst: int = COMMAND_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_second, self.burst, self.clock = per_second, burst, clock
        self._buckets: dict[str, TokenBucket] = {}
        self.refused = 0

    @classmethod
    def from_env(cls) -> TenantThrottle:
        """POOL_TENANT_COMMANDS_PER_SECOND and POOL_TENANT_COMMAND_BURST, or the defaults."""
        return cls(int(os.environ.get("POOL_TENANT_COMMANDS_PER_SECOND")
                         or COMMANDS_PER_SECOND),
                   int(os.environ.get("POOL_TENANT_COMMAND_BURST") or COMMAND_BURST))

    def __call__(self, subject: str) -> tuple[str, bytes] | None:
        if not subject.startswith(PREFIX):
            return None  # a node's report, an operator's command: other lanes and limits
        tenant = subject.split(".", 3)[2]
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket.full(self.burst, now)
        wait = bucket.take(now, rate_per_second=self.per_second, burst=self.burst)
        if not wait:
            return None
        self.refused += 1
        return tenant, self.refusal(wait)

    def refusal(self, wait: float) -> bytes:
        retry = max(1, math.ceil(wait))
        return json.dumps({"ok": False, "error": {
            "code": "rate_limited",
            "message": f"this tenant sent commands faster than its tenant_commands_per_second "
                       f"of {self.per_second} (tenant_command_burst {self.burst}); retry in "
                       f"{retry} s",
            "reasons": {"tenant_commands_per_second": self.per_second,
                        "tenant_command_burst": self.burst,
                        "retry_after_seconds": retry}}}).encode()
