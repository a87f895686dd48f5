"""A cluster's store from before accounts (every stream in the global account, in the cluster's
metadata) keeps its streams when the cluster starts with users: they are moved to POOL, the
same messages at the same sequences, gaps and consumers kept (ADR 027)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from uuid import uuid4

import nats

from bus.local.auth import AuthConfig
from bus.local.cluster import NatsCluster
from bus.local.global_store import PARKED, has_global_streams
from bus.subjects import EVENTS_STREAM


async def _state(url: str) -> dict[str, Any]:
    nc = await nats.connect(servers=url.split(","))
    try:
        js = nc.jetstream()
        info = await js.stream_info(EVENTS_STREAM)
        third = await js.get_msg(EVENTS_STREAM, 3)
        consumers = sorted(c.name for c in await js.consumers_info("POOL_SCHED"))
        return {"last": info.state.last_seq, "messages": info.state.messages,
                "third": (third.subject, third.data), "consumers": consumers,
                "streams": sorted(s.config.name for s in await js.streams_info())}
    finally:
        await nc.close()


async def _write(url: str) -> None:
    nc = await nats.connect(servers=url.split(","))
    try:
        js = nc.jetstream()
        for i in range(5):
            await js.publish(f"pool.evt.lease.l{i}", b"event %d" % i)
        await js.purge_stream(EVENTS_STREAM, subject="pool.evt.lease.l1")  # a gap
    finally:
        await nc.close()


def test_a_clusters_streams_from_before_accounts_are_moved_to_pool(tmp_path: Path) -> None:
    root, name = tmp_path / "cluster", f"pool-test-{uuid4().hex[:8]}"
    with NatsCluster(root, nodes=3, cluster_name=name) as old:  # no users: all in `$G`
        old.ensure_streams(replicas=3)
        asyncio.run(_write(old.url))
        before = asyncio.run(_state(old.url))
    assert has_global_streams([s.store_dir for s in old.servers])
    auth = AuthConfig()
    auth.add_tenant("alpha")
    with NatsCluster(root, nodes=3, cluster_name=name, auth=auth) as new:
        after = asyncio.run(_state(new.service_url))
        assert not has_global_streams([s.store_dir for s in new.servers])
    assert before["third"] == (b"pool.evt.lease.l2".decode(), b"event 2")
    assert after == before
    assert not any((root / PARKED).glob("*"))
