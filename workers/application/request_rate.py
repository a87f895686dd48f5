"""Each tenant's token bucket for lease requests in each pool, kept by this command service
process: the pool decides (Pool.admit_request_rate), this remembers the buckets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from domain.pool import Pool
from domain.rate import TokenBucket

Key = tuple[str, str]  # (tenant, pool)


class RequestRate:
    """Per (tenant, pool), the bucket its lease requests take from. Counted per process: N
    command services let a tenant through at up to N times the pool's rate."""

    def __init__(self) -> None:
        self._buckets: dict[Key, TokenBucket] = {}
        self._lock = threading.Lock()

    def admit(self, pool: Pool, tenant: str, now: float) -> Key:
        """Take a token of `tenant` in `pool` (RateLimited when none is left); returns the
        bucket's key, for `give_back`."""
        key = (tenant, str(pool.pool_id))
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = TokenBucket.full(pool.config.request_burst, now)
            pool.admit_request_rate(tenant, bucket, now)
        return key

    def give_back(self, keys: Iterable[Key], pool: Pool) -> None:
        """Return the tokens of requests that are run again (the fast path handing over to a
        thread), so one request takes one token."""
        with self._lock:
            for key in keys:
                bucket = self._buckets.get(key)
                if bucket is not None:
                    bucket.give_back(pool.config.request_burst)
