"""JetStream stream definitions — the event log, the snapshots, the agents' work queue, the
timers, telemetry (node-level and each tenant's), the tenants' lease feed, the scheduler's decisions — and an idempotent ensure helper every process may call at start-up."""

from __future__ import annotations

import dataclasses
import uuid

import stamina
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from bus.subjects import (
    AGENT_STREAM,
    APPENDED_PREFIX,
    CHECKPOINT_PREFIX,
    CHECKPOINT_STREAM,
    DECISIONS_PREFIX,
    DECISIONS_STREAM,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    FEED_LIVE_PREFIX,
    FEED_PREFIX,
    FEED_STREAM,
    NODE_TELEMETRY_SUBJECTS,
    SCHEDULE_STREAM,
    SNAPSHOTS_PREFIX,
    SNAPSHOTS_STREAM,
    TELEMETRY_STREAM,
    TRACKING_PREFIX,
    tenant_telemetry_stream,
    tenant_telemetry_subjects,
    token,
)

DUPLICATE_WINDOW_S = 120.0


def event_stream_config(*, replicas: int = 1, name: str = EVENTS_STREAM) -> StreamConfig:
    """The event log: never discards, atomic batches for multi-aggregate saves, direct gets,
    and a headers-only republish of every stored event (the append signal)."""
    return StreamConfig(
        name=name,
        subjects=[f"{EVENTS_PREFIX}.>", f"{TRACKING_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        # an event log is the source of truth: no limits, so nothing is ever aged out
        max_msgs=-1,
        max_bytes=-1,
        max_age=0,
        max_msgs_per_subject=-1,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_atomic=True,
        allow_direct=True,
        # history must be immutable once written
        deny_delete=True,
        deny_purge=False,
        # each event's headers, once stored, on pool.appended.<application>.<id>: what idle
        # workers wake on instead of polling (bus.appends)
        republish=RePublish(src=f"{EVENTS_PREFIX}.>", dest=f"{APPENDED_PREFIX}.>",
                            headers_only=True),
    )



def _latest_per_subject(name: str, prefix: str, replicas: int) -> StreamConfig:
    """A stream under `prefix` that keeps only the latest message of each subject (a cache
    the log can rebuild, never a source of truth)."""
    return StreamConfig(
        name=name,
        subjects=[f"{prefix}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )

def snapshot_stream_config(*, replicas: int = 1, name: str = SNAPSHOTS_STREAM) -> StreamConfig:
    """POOL_SNAPSHOTS: the latest snapshot of each account, node and pool on
    pool.snap.<application>.<id>, one message kept a subject (an older one is discarded when a
    newer one is stored). Not a source of truth: purging it only costs loads their histories."""
    return _latest_per_subject(name, SNAPSHOTS_PREFIX, replicas)


def snapshot_stream_name(events_stream: str) -> str:
    """The snapshot stream beside event stream `events_stream`: POOL_SNAPSHOTS beside
    POOL_EVENTS, `<name>_SNAPSHOTS` beside any other (a test's own log)."""
    return SNAPSHOTS_STREAM if events_stream == EVENTS_STREAM else f"{events_stream}_SNAPSHOTS"


# A reload that adds a tenant's account (ADR 027) wires every account's JetStream API again:
# for a few milliseconds its requests find no responder (503, seen about once a reload). The
# management calls made at a process's start, all idempotent, are tried again through it.
through_reloads = stamina.retry(on=ServiceUnavailableError, attempts=20, timeout=10.0,
                                wait_initial=0.02, wait_max=0.5)


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create `config.name`, or update it in place when it already exists.

    An update never lowers the replica count: every process ensures its streams at start-up
    with its own default (1), and must not shrink the cluster's R3 streams to one copy."""
    assert config.name
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        return
    existing = info.config.num_replicas or 1
    if (config.num_replicas or 1) < existing:
        config = dataclasses.replace(config, num_replicas=existing)
    await js.update_stream(config)


async def ensure_event_stream(
    js: JetStreamContext, *, replicas: int = 1, name: str = EVENTS_STREAM
) -> None:
    await ensure_stream(js, event_stream_config(replicas=replicas, name=name))


async def ensure_kv_bucket(js: JetStreamContext, bucket: str, *, replicas: int = 1,
                           history: int = 1, ttl_seconds: float | None = None) -> None:
    """Create KV `bucket` at `replicas`, or raise an existing one's replicas to `replicas`;
    its other settings (TTL, history) are left as they are."""
    try:
        info = await js.stream_info(f"KV_{bucket}")
    except NotFoundError:
        try:
            await js.create_key_value(KeyValueConfig(bucket=bucket, history=history,
                                                     ttl=ttl_seconds, replicas=replicas))
        except BadRequestError:
            pass  # created concurrently by its first user
        return
    if (info.config.num_replicas or 1) < replicas:
        await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))


# POOL_TELEMETRY keeps node-level samples for 7 days and at most 64 MiB, the oldest discarded
# first (a store from before each tenant had a stream keeps its 1 GiB: bus.telemetry)
TELEMETRY_MAX_AGE_S = 7 * 24 * 3600.0
TELEMETRY_MAX_BYTES = 64 * 1024 * 1024
# each tenant's stream POOL_TEL_<tenant> keeps its samples for 7 days and at most 256 MiB
# unless the operator says otherwise (`pool admin tenant telemetry-retention`). The server
# reserves every stream's max_bytes from its JetStream store (max_file_store), as it does a
# file bucket's quota, so the default is four jobs' full output (max_output_bytes, 64 MiB),
# not more: a tenant's three streams (two buckets and this) then reserve 2.25 GiB
TENANT_TELEMETRY_MAX_BYTES = 256 * 1024 * 1024
TENANT_TELEMETRY_MAX_AGE_S = TELEMETRY_MAX_AGE_S


def scratch_stream_config(prefix: str) -> StreamConfig:
    """A throwaway stream for a raw-ingest benchmark, named `<PREFIX>_<random>` with subjects
    `<prefix>.<name>.>`: file storage and atomic batches, as the event log has."""
    name = f"{prefix.upper()}_{uuid.uuid4().hex[:8].upper()}"
    return StreamConfig(name=name, subjects=[f"{prefix}.{name}.>"], storage=StorageType.FILE,
                        allow_atomic=True)


def agent_stream_config(*, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=AGENT_STREAM,
        subjects=["pool.agent.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        num_replicas=replicas,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


def schedule_stream_config(*, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=SCHEDULE_STREAM,
        subjects=["pool.sched.>", "pool.due.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        # one live timer and one fired message per lease or node is all that matters
        max_msgs_per_subject=1,
        discard=DiscardPolicy.OLD,
        allow_msg_schedules=True,
        allow_atomic=True,  # the dispatcher arms a page's timers as one batch
    )


def telemetry_stream_config(replicas: int = 1) -> StreamConfig:
    """POOL_TELEMETRY: node-level samples (`pool.tel.node.<node>.<kind>`, a tenant's lease in
    none) and, on a store from before each tenant had its own stream, the tenants' samples
    stored then, read until they age out; limits retention (7 days, 64 MiB), oldest first."""
    return StreamConfig(
        name=TELEMETRY_STREAM,
        subjects=[NODE_TELEMETRY_SUBJECTS],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=TELEMETRY_MAX_AGE_S,
        max_bytes=TELEMETRY_MAX_BYTES,
        max_msgs=-1,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )


def tenant_telemetry_stream_config(tenant: str, *, replicas: int = 1,
                                   max_bytes: int = TENANT_TELEMETRY_MAX_BYTES,
                                   max_age_seconds: float = TENANT_TELEMETRY_MAX_AGE_S,
                                   first_seq: int = 1) -> StreamConfig:
    """POOL_TEL_<tenant>: the tenant's telemetry over `pool.tel.*.*.<tenant>.>`, limits
    retention with its own `max_bytes` and `max_age`, the tenant's oldest samples discarded
    first (never another tenant's). `first_seq` above the last sequence of POOL_TELEMETRY when
    it was made, so a replay's cursor runs on from the samples stored there before the split."""
    return StreamConfig(
        name=tenant_telemetry_stream(tenant),
        subjects=[tenant_telemetry_subjects(tenant)],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=max_age_seconds,
        max_bytes=max_bytes,
        max_msgs=-1,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
        first_seq=first_seq if first_seq > 1 else None,
        description=f"computepool telemetry: tenant {token(tenant)}",
    )


# POOL_FEED keeps lease state changes for 7 days and at most 256 MiB, the oldest discarded first
FEED_MAX_AGE_S = 7 * 24 * 3600.0
FEED_MAX_BYTES = 256 * 1024 * 1024


def feed_stream_config(replicas: int = 1) -> StreamConfig:
    """POOL_FEED: the tenants' lease feed, limits retention (7 days, 256 MiB). Written only in
    atomic batches that expect the stream's last sequence, so two writers (or one restarted)
    never store a record twice; each stored record is republished with its sequence on
    pool.feedlive.<tenant>.…, what live readers subscribe to."""
    return StreamConfig(
        name=FEED_STREAM,
        subjects=[f"{FEED_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=FEED_MAX_AGE_S,
        max_bytes=FEED_MAX_BYTES,
        max_msgs=-1,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_atomic=True,
        allow_direct=True,
        republish=RePublish(src=f"{FEED_PREFIX}.>", dest=f"{FEED_LIVE_PREFIX}.>"),
    )


def checkpoint_stream_config(replicas: int = 1) -> StreamConfig:
    """POOL_CHECKPOINTS: the scheduler's checkpoints of its fold (bus.checkpoints), each a
    head on pool.ckpt.<name>.head and its chunks on pool.ckpt.<name>.<slot>.<n>, one message
    kept a subject. Not a source of truth: purging it only costs the next start-up a full
    replay."""
    return _latest_per_subject(CHECKPOINT_STREAM, CHECKPOINT_PREFIX, replicas)


# POOL_DECISIONS keeps the scheduler's recorded wait reasons for 30 days and at most 1 GiB
DECISIONS_MAX_AGE_S = 30 * 24 * 3600.0
DECISIONS_MAX_BYTES = 1024 * 1024 * 1024


def decisions_stream_config(replicas: int = 1, *,
                            max_age_seconds: float = DECISIONS_MAX_AGE_S) -> StreamConfig:
    """POOL_DECISIONS: why each waiting lease waited, recorded on change by the scheduler in
    one atomic batch a cycle and pool (bus.decisions); limits retention (30 days unless
    given, 1 GiB), oldest first. Not the event log: losing it loses only `why --at`."""
    return StreamConfig(
        name=DECISIONS_STREAM,
        subjects=[f"{DECISIONS_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=max_age_seconds,
        max_bytes=DECISIONS_MAX_BYTES,
        max_msgs=-1,
        discard=DiscardPolicy.OLD,
        allow_atomic=True,
        allow_direct=True,
    )
