"""The computepool Python SDK: `Client` (sync) and `AsyncClient` over NATS or the HTTP gateway,
typed with the wire's msgspec Structs; errors are `PoolError` (docs/sdk.md)."""

from __future__ import annotations

from computepool.aio import AsyncClient
from computepool.client import Artifact, Client, LeaseList, RunResult
from computepool.errors import PoolError
from gateway.wire import Lease
from schemas.feed import FeedRecord

__all__ = ["Artifact", "AsyncClient", "Client", "FeedRecord", "Lease", "LeaseList", "PoolError",
           "RunResult"]
