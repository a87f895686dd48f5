"""Version 1's node agent messages: registration, heartbeats and drains the agent sends, the
assignments and revocations it receives, and its reports on each job.
"""

# msgspec gives each instance its own copy of a mutable default; ruff sees that only when
# msgspec.Struct is a base in the same file, not through the imported bases.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from schemas.hostaccess import MAX_EGRESS_ALLOW, MAX_JOB_VOLUMES, EgressCidr, VolumeMount
from schemas.v1_leases import JobSpec
from schemas.v1_resources import NodeCapabilitiesSpec, ResourceShape, Utilization
from schemas.v1_vocabulary import (
    MAX_GPU_COUNT,
    MAX_LEASES_PER_REQUEST,
    MAX_WORKDIR_BYTES,
    CommandBase,
    Count,
    DeviceId,
    OutputBytes,
    PartBase,
    Reason,
    SubjectToken,
    UnixSeconds,
)


class NodeRegistration(CommandBase, frozen=True, kw_only=True):
    """A node agent joins a pool and publishes its allocatable capacity and traits."""

    node_id: SubjectToken
    pool_id: SubjectToken
    capabilities: NodeCapabilitiesSpec


class LeaseBeat(PartBase, frozen=True, kw_only=True):
    """One lease the agent is running, in its node heartbeat; the epoch fences old placements."""

    lease_id: SubjectToken
    epoch: Count
    last_checkpoint_at: UnixSeconds | None = None


class NodeHeartbeat(CommandBase, frozen=True, kw_only=True):
    """A node agent is alive; it lists the leases it runs so the pool can keep each alive, and
    reconcile the ones it no longer runs. One heartbeat is one atomic save for all of them."""

    node_id: SubjectToken
    seq: Count
    leases: Annotated[list[LeaseBeat], Meta(max_length=4096)] = []
    utilization: Utilization | None = None


class NodeDrain(CommandBase, frozen=True, kw_only=True):
    """A node asks to take no new leases (maintenance); running ones finish or are moved."""

    reason: Reason | None = None


class LeaseAssignment(CommandBase, frozen=True, kw_only=True):
    """The pool tells a node agent to start a committed lease's job."""

    lease_id: SubjectToken
    epoch: Count
    shape: ResourceShape
    job: JobSpec
    deadline_at: UnixSeconds
    tenant: SubjectToken = "unknown"
    pool_id: SubjectToken = "unknown"
    job_number: Annotated[int, Meta(ge=1, le=2**31)] = 1
    # the pool's image policy in force, so the agent checks the image again before start
    image_policy: Annotated[dict[str, Any], Meta(max_length=64)] | None = None
    # the node's GPU devices this lease holds: the workload sees these and no other
    devices: Annotated[list[DeviceId], Meta(max_length=MAX_GPU_COUNT)] = []
    # the pool's artifact settings in force: how long stored artifacts live, how many bytes
    artifact_ttl_seconds: Annotated[int, Meta(ge=1, le=365 * 86_400)] = 7 * 86_400
    max_artifact_bytes: Annotated[int, Meta(ge=0, le=MAX_WORKDIR_BYTES)] = 1 << 30
    # the pool's output cap: the job's output past it is neither stored nor shipped
    max_output_bytes: OutputBytes = 64 << 20
    # which attempt of the lease this is (1, then 2, … as it is retried): the job's POOL_ATTEMPT
    attempt: Annotated[int, Meta(ge=1, le=2**31)] = 1
    # its place among the leases of one `count` request (POOL_ARRAY_INDEX, POOL_ARRAY_SIZE);
    # left out for a lone lease
    array_index: Annotated[int, Meta(ge=0, le=MAX_LEASES_PER_REQUEST)] | None = None
    array_size: Annotated[int, Meta(ge=0, le=MAX_LEASES_PER_REQUEST)] = 0
    # the pool's volumes the job asked for, resolved to host paths from the pool's settings
    volumes: Annotated[list[VolumeMount], Meta(max_length=MAX_JOB_VOLUMES)] = []
    # the pool's egress allow-list in force, added by the node's runtime to the operator's own
    egress_allow: Annotated[list[EgressCidr], Meta(max_length=MAX_EGRESS_ALLOW)] = []


class LeaseRevocation(CommandBase, frozen=True, kw_only=True):
    """The pool tells a node agent to stop a lease (preempted, cancelled or expired)."""

    lease_id: SubjectToken
    epoch: Count
    grace_seconds: Annotated[int, Meta(ge=0, le=3600)] = 30
    reason: Reason | None = None


class LeaseStopped(CommandBase, frozen=True, kw_only=True):
    """A node agent confirms a lease's workload is gone (after a preemption, cancel or expiry);
    only then is its capacity returned. The epoch fences a report from an older placement."""

    epoch: Count


class JobStarted(CommandBase, frozen=True, kw_only=True):
    """A node agent reports the lease's current job is running (its process started)."""

    epoch: Count
    job_number: Annotated[int, Meta(ge=1, le=2**31)] = 1
    startup_seconds: Annotated[float, Meta(ge=0, le=86_400)] | None = None


class JobExited(CommandBase, frozen=True, kw_only=True):
    """A node agent reports the lease's current job exited; the lease is released with it."""

    epoch: Count
    exit_code: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]


class JobFailed(CommandBase, frozen=True, kw_only=True):
    """A node agent reports the job could not run (image refused, start failed, killed)."""

    epoch: Count
    reason: Reason


