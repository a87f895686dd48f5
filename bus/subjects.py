"""Subject and stream names: the one place that spells them.

Tokens are lowercase a-z, 0-9, '-' and '_'; ids come last so wildcards select by kind.
"""

from __future__ import annotations

import re

from bus.errors import InvalidSubject

EVENTS_STREAM = "POOL_EVENTS"
EVENTS_PREFIX = "pool.evt"
TRACKING_PREFIX = "pool.trk"
# where the event stream republishes each stored event's headers (never its body): the signal
# idle log followers wait on (bus.appends); only the service user may subscribe
APPENDED_PREFIX = "pool.appended"
APPENDED_FILTER = f"{APPENDED_PREFIX}.>"
AGENT_STREAM = "POOL_AGENT"
TELEMETRY_STREAM = "POOL_TELEMETRY"
SCHEDULE_STREAM = "POOL_SCHED"
# each tenant's feed of its own leases' state changes, stored on pool.feed.<tenant>.lease.<id>
# and, once stored, republished with its sequence on pool.feedlive.<tenant>.lease.<id>
FEED_STREAM = "POOL_FEED"
WEBHOOK_BUCKET = "pool_webhooks"  # the webhook deliveries' state (bus.webhooks)
FEED_PREFIX = "pool.feed"
FEED_LIVE_PREFIX = "pool.feedlive"
# questions one scheduler process asks the leader of a pool (bus.lead); scheduler users only
LEAD_PREFIX = "pool.lead"
# an operator's questions the scheduler processes answer from memory (`pool shares`): apart
# from `pool.admin.>`, which the command service answers whole; admin users only
OPS_PREFIX = "pool.ops"
# the scheduler's checkpoints of its fold (bus.checkpoints): written and read by scheduler users only
CHECKPOINT_STREAM = "POOL_CHECKPOINTS"
CHECKPOINT_PREFIX = "pool.ckpt"
# the latest snapshot of each account, node and pool (bus.jetstream.snapshots), one message a
# subject: kept apart from the event log, so the log holds only events and the server drops a
# snapshot once a newer one of its aggregate is stored
SNAPSHOTS_STREAM = "POOL_SNAPSHOTS"
SNAPSHOTS_PREFIX = "pool.snap"
# the scheduler's record of why each waiting lease waits, on change only (bus.decisions):
# pool.dec.<tenant>.<lease>, its own stream with its own retention, apart from the event log
DECISIONS_STREAM = "POOL_DECISIONS"
DECISIONS_PREFIX = "pool.dec"
# each tenant's file buckets (bus.objects): its packed work directories, which nodes read, and
# its jobs' artifacts, which nodes write
WORK_BUCKET_PREFIX = "pool_work_"
ARTIFACTS_BUCKET_PREFIX = "pool_out_"
# the tenants' job secrets, sealed (bus.secrets): `<tenant>.<name>`; the command role's only
SECRETS_BUCKET = "pool_secrets"

_TOKEN = re.compile(r"^[a-z0-9_-]{1,128}$")


def token(value: str) -> str:
    """`value` made safe as one subject token (lowercased; anything else becomes '_')."""
    t = re.sub(r"[^a-z0-9_-]", "_", value.lower())
    if not t:
        raise ValueError("empty subject token")
    return t


def is_token(value: str) -> bool:
    return bool(_TOKEN.match(value))


def event_subject(aggregate_type: str, aggregate_id: str) -> str:
    return f"{EVENTS_PREFIX}.{token(aggregate_type)}.{token(aggregate_id)}"


def snapshot_subject(application_name: str, aggregate_id: str) -> str:
    """`pool.snap.<application>.<aggregate-id>`: where an aggregate's latest snapshot lives."""
    return f"{SNAPSHOTS_PREFIX}.{token(application_name)}.{token(aggregate_id)}"


def tracking_subject(application_name: str) -> str:
    return f"{TRACKING_PREFIX}.{token(application_name)}"


def command_subject(tenant: str, *rest: str) -> str:
    """`pool.cmd.<tenant>.<rest…>`; a tenant or part that is not one subject token is refused
    (InvalidSubject), never rewritten into another name."""
    for part in (tenant, *rest):
        if not is_token(part):
            raise InvalidSubject(f"not a subject token: {part!r}")
    return ".".join(["pool.cmd", tenant, *rest])


def admin_subject(path: str) -> str:
    """`pool.admin.<path>`: an operator's command (path tokens are the caller's, e.g. pool.set)."""
    return f"pool.admin.{path}"


def agent_subject(node_id: str, verb: str) -> str:
    return f"pool.agent.{token(node_id)}.{verb}"


TELEMETRY_PREFIX = "pool.tel"


def telemetry_subject(pool: str, node: str, tenant: str, lease: str, kind: str) -> str:
    """`pool.tel.<pool>.<node>.<tenant>.<lease>.<kind>`.

    The tenant is its own token (the design note had none): NATS wildcards match whole tokens,
    so this is what lets a tenant's permission `pool.tel.*.*.<tenant>.>` select its leases.
    """
    return (
        f"{TELEMETRY_PREFIX}.{token(pool)}.{token(node)}.{token(tenant)}.{token(lease)}.{token(kind)}"
    )


# each tenant's telemetry in a stream of its own, POOL_TEL_<tenant>, over
# pool.tel.*.*.<tenant>.>: its retention is the tenant's alone, so one tenant's volume never
# evicts another's samples (docs/adr/024-telemetry-retention-per-tenant.md). Tenants' filters
# differ in a literal token and never overlap; POOL_TELEMETRY keeps the node-level subjects,
# which have fewer tokens than any tenant's, and a store's samples from before the split
TENANT_TELEMETRY_STREAM_PREFIX = "POOL_TEL_"
NODE_TELEMETRY_SUBJECTS = f"{TELEMETRY_PREFIX}.node.*.*"


def tenant_telemetry_stream(tenant: str) -> str:
    """`POOL_TEL_<tenant>`: the stream that keeps `tenant`'s telemetry."""
    return TENANT_TELEMETRY_STREAM_PREFIX + token(tenant)


def tenant_telemetry_subjects(tenant: str) -> str:
    """`pool.tel.*.*.<tenant>.>`: every telemetry subject of `tenant`'s leases."""
    return f"{TELEMETRY_PREFIX}.*.*.{token(tenant)}.>"


def telemetry_tenant_of(filter_subject: str) -> str | None:
    """The tenant token of a telemetry subject or filter, None when it is a wildcard (or the
    subject is not a lease's)."""
    parts = filter_subject.split(".")
    if len(parts) < 6 or parts[:2] != TELEMETRY_PREFIX.split(".") or parts[4] in ("*", ">"):
        return None
    return parts[4]


def feed_subject(tenant: str, lease_id: str) -> str:
    """`pool.feed.<tenant>.lease.<lease_id>`: where the control plane stores one lease's
    state changes (the tenant its own token, so a permission selects exactly its leases)."""
    return feed_lease_prefix(tenant) + token(lease_id)


def feed_lease_prefix(tenant: str) -> str:
    """`pool.feed.<tenant>.lease.`: a tenant's feed subjects but for the lease id."""
    return f"{FEED_PREFIX}.{token(tenant)}.lease."


def feed_filter(tenant: str, lease: str | None = None, *, live: bool = False) -> str:
    """The subject filter of one tenant's feed: one lease, or all of them (`*`)."""
    prefix = FEED_LIVE_PREFIX if live else FEED_PREFIX
    return f"{prefix}.{token(tenant)}.lease.{token(lease) if lease else '*'}"


def output_filter(tenant: str, lease: str) -> str:
    """Every `output` sample of one lease, whatever its pool and node (a tenant may read these:
    bus/local/auth.py)."""
    return f"{TELEMETRY_PREFIX}.*.*.{token(tenant)}.{token(lease)}.output"


def decision_subject(tenant: str, lease_id: str) -> str:
    """`pool.dec.<tenant>.<lease_id>`: where the scheduler records one lease's wait reasons
    (the tenant its own token, so a reader selects exactly one tenant's lease)."""
    return f"{DECISIONS_PREFIX}.{token(tenant)}.{token(lease_id)}"


def schedule_subject(lease_id: str) -> str:
    return f"pool.sched.lease.{token(lease_id)}"


def due_subject(lease_id: str) -> str:
    return f"pool.due.lease.{token(lease_id)}"


def lead_subject(pool: str, verb: str) -> str:
    """`pool.lead.<pool>.<verb>`: a question for the scheduler process leading `pool`."""
    return f"{LEAD_PREFIX}.{token(pool)}.{token(verb)}"


def lead_filter(pool: str) -> str:
    """`pool.lead.<pool>.*`: every question for the leader of `pool`."""
    return f"{LEAD_PREFIX}.{token(pool)}.*"


SESSION_PREFIX = "pool.sess"


def session_subject(tenant: str, node: str, session_id: str, direction: str) -> str:
    """`pool.sess.<tenant>.<node>.<session>.<in|out>`: one interactive session's bytes, `in`
    from its tenant to the node, `out` back. Tenant and node are whole tokens, so the server's
    permissions give each only its own (bus.local.auth)."""
    if direction not in ("in", "out"):
        raise InvalidSubject(f"no session direction {direction!r}")
    for part in (tenant, node, session_id):
        if not is_token(part):
            raise InvalidSubject(f"not a subject token: {part!r}")
    return f"{SESSION_PREFIX}.{tenant}.{node}.{session_id}.{direction}"
