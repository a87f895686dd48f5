"""A lease's placement on a node, written to its feed as the control plane would: what lets a
test's hand-published telemetry pass the check that its node held its lease."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats

from bus.subjects import feed_subject
from schemas.feed import FeedRecord


def place_on(url: str, tenant: str, lease: str, node: str, pool: str = "p1") -> None:
    """Record on `lease`'s feed that it was reserved on `node` (`url`: as the plane's user)."""
    record = FeedRecord(lease_id=lease, tenant=tenant, pool_id=pool, state="reserved",
                        previous_state="queued", event="LeaseReserved", node_id=node,
                        epoch=1, version=2, log_sequence=1, at=time.time())

    async def go() -> None:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().publish(feed_subject(tenant, lease),
                                         msgspec.json.encode(record))
        finally:
            await nc.close()

    asyncio.run(go())
