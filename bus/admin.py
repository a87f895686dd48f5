"""Synchronous administration of the streams for the CLI: create them, describe them.

Short-lived connections only; long-running processes use bus.runtime instead.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from nats.errors import Error as NatsError

from bus.connection import connect
from bus.runtime import run_sync
from bus.subjects import EVENTS_STREAM

T = TypeVar("T")


def admin_run(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` on the process's shared loop thread, nats errors (a timeout while a cluster
    elects a leader) as bus.errors."""
    return run_sync(coro)


async def admin_connect(url: str) -> Any:
    # a cluster's URL list may name a server that is down: the next one is tried, quietly
    return await connect(url, max_reconnect_attempts=0)


def ensure_all_streams(url: str, *, replicas: int = 1, tenants: Sequence[str] = ()) -> None:
    """Create or update every stream the system uses at `replicas`: the event log, the
    snapshots, the agent work queue, the timers with the reconciler's durable consumer,
    telemetry, the lease feed, the scheduler's checkpoints and decisions, the leader bucket, the webhook
    deliverer's consumer and bucket, the tenants' sealed secrets and the telemetry stream of
    each of `tenants` (its retention kept). An existing stream with more replicas keeps them
    (no implicit scale-down)."""
    from bus.agentbus import ensure_data_plane_streams
    from bus.leader import ensure_leader_bucket
    from bus.secrets import ensure_secrets_bucket
    from bus.streams import (
        checkpoint_stream_config,
        decisions_stream_config,
        ensure_event_stream,
        ensure_stream,
        feed_stream_config,
        snapshot_stream_config,
    )
    from bus.telemetry import ensure_telemetry_stream
    from bus.telemetry_streams import ensure_tenant_telemetry
    from bus.webhooks import ensure_webhook_consumer

    async def go() -> None:
        nc = await admin_connect(url)
        try:
            js = nc.jetstream()
            await ensure_event_stream(js, replicas=replicas)
            await ensure_stream(js, snapshot_stream_config(replicas=replicas))
            await ensure_data_plane_streams(js, replicas=replicas)
            await ensure_telemetry_stream(js, replicas=replicas)
            await ensure_stream(js, feed_stream_config(replicas))
            await ensure_stream(js, checkpoint_stream_config(replicas))
            await ensure_stream(js, decisions_stream_config(replicas))
            await ensure_leader_bucket(js, replicas=replicas)
            await ensure_webhook_consumer(js, replicas=replicas)
            await ensure_secrets_bucket(js, replicas=replicas)
            for tenant in tenants:
                await ensure_tenant_telemetry(js, tenant, replicas=replicas)
        finally:
            await nc.close()

    admin_run(go())


def describe_streams(url: str) -> list[dict[str, Any]]:
    """Name, message count, last sequence and subjects of each stream on the server."""

    async def go() -> list[dict[str, Any]]:
        nc = await admin_connect(url)
        try:
            jsm = nc.jsm()
            out = []
            for info in await jsm.streams_info():
                out.append(
                    {
                        "name": info.config.name,
                        "messages": info.state.messages,
                        "last_seq": info.state.last_seq,
                        "subjects": ",".join(info.config.subjects or []),
                        "replicas": info.config.num_replicas,
                    }
                )
            return sorted(out, key=lambda s: (s["name"] != EVENTS_STREAM, s["name"]))
        finally:
            await nc.close()

    return admin_run(go())


async def _quiet(_exc: Exception) -> None:
    pass  # nats-py reports every connection error; a refused probe is an answer, not news


def can_connect(url: str, *, user: str, password: str, timeout: float = 2.0) -> bool:
    """Whether `user` can log in at `url` right now (e.g. after a configuration reload)."""

    async def go() -> bool:
        try:
            nc = await connect(url, reconnect=False, user=user, password=password,
                               connect_timeout=timeout)
        except Exception:  # noqa: BLE001 - refused or not reloaded yet: both mean "not now"
            return False
        await nc.close()
        return True

    return run_sync(go())


def leaders(url: str, bucket: str = "pool_leaders") -> dict[str, dict[str, Any]]:
    """Each election's current holder record in the leader bucket (empty: no holder now)."""
    import json

    async def go() -> dict[str, dict[str, Any]]:
        nc = await admin_connect(url)
        try:
            try:
                kv = await nc.jetstream().key_value(bucket)
                keys = await kv.keys()
            except NatsError:  # no bucket yet, or no keys in it
                return {}
            out: dict[str, dict[str, Any]] = {}
            for key in keys:
                try:
                    entry = await kv.get(key)
                    record = json.loads(entry.value or b"{}")
                except (NatsError, ValueError):
                    continue
                out[key] = record if isinstance(record, dict) else {"value": record}
            return out
        finally:
            await nc.close()

    return admin_run(go())
