"""Version 1's lease commands: a request (batches, gangs, retries, dependencies), its job, and
the holder's commit, heartbeat, renewal, release and cancel.
"""

# msgspec gives each instance its own copy of a mutable default; ruff sees that only when
# msgspec.Struct is a base in the same file, not through the imported bases.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from domain.gang import MAX_GANG_MEMBERS
from domain.policy.gang import GangSpec
from schemas.hostaccess import MAX_JOB_VOLUMES, VolumeName, VolumeTarget
from schemas.v1_resources import ResourceShape, Utilization
from schemas.v1_vocabulary import (
    MAX_ARTIFACT_GLOBS,
    MAX_JOB_SECRETS,
    MAX_LEASE_LABELS,
    MAX_LEASES_PER_REQUEST,
    MAX_WORKDIR_BYTES,
    ArtifactGlob,
    CheckpointMode,
    Command,
    CommandBase,
    Count,
    Environment,
    EnvName,
    IdempotencyKey,
    ImageRef,
    ImageSignature,
    ImageSizeBytes,
    LabelKey,
    LabelValue,
    LeaseName,
    NameToken,
    PartBase,
    Reason,
    RuntimeSeconds,
    SecretName,
    SecretPath,
    SubjectToken,
    UnixSeconds,
    WorkdirDigest,
)

TopologyKey = Literal["rack", "block", "nvlink_domain", "zone", "failure_domain"]
GangStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


RetryReason = Literal["failed", "node_lost", "heartbeat_lost", "preempted", "deadline"]
MAX_ATTEMPTS_LIMIT = 100  # the most any pool may allow (PoolConfig.max_attempts)


class RetryPolicy(PartBase, frozen=True, kw_only=True):
    """Run the lease again when an attempt ends with one of the reasons in `on`, up to
    `max_attempts` attempts in all; the n-th retry waits backoff_seconds * 2^(n-1) (at most
    backoff_max_seconds) before it queues again."""

    max_attempts: Annotated[int, Meta(ge=1, le=MAX_ATTEMPTS_LIMIT)]
    on: Annotated[list[RetryReason], Meta(min_length=1, max_length=5)] = msgspec.field(
        default_factory=lambda: ["failed"])
    backoff_seconds: Annotated[int, Meta(ge=0, le=86_400)] = 0
    backoff_max_seconds: Annotated[int, Meta(ge=0, le=86_400)] = 3600


DependencyCondition = Literal["ok", "any", "notok"]
MAX_DEPENDENCIES = 64


class LeaseDependency(PartBase, frozen=True, kw_only=True):
    """Wait for another lease of the same tenant to end: `ok` (it succeeded), `notok` (it
    ended any other way) or `any`."""

    lease_id: SubjectToken
    condition: DependencyCondition = "ok"


class LeaseGroup(PartBase, frozen=True, kw_only=True):
    """A gang: `members` leases, one node each, placed all-or-nothing in one atomic save and
    committed, renewed, preempted and requeued together. `same` packs them into one value
    of a topology label, `spread` puts each on a distinct value; alone each is strict
    (STRICT_PACK, STRICT_SPREAD), `strategy` may soften it (PACK, SPREAD)."""

    members: Annotated[int, Meta(ge=1, le=MAX_GANG_MEMBERS)]
    # one shape per member, in member order; empty: every member has the request's shape
    member_shapes: Annotated[list[ResourceShape], Meta(max_length=MAX_GANG_MEMBERS)] = []
    same: TopologyKey | None = None
    spread: TopologyKey | None = None
    strategy: GangStrategy | None = None

    def __post_init__(self) -> None:
        if self.member_shapes and len(self.member_shapes) != self.members:
            raise ValueError(f"member_shapes lists {len(self.member_shapes)} shape(s) for "
                             f"{self.members} member(s)")
        GangSpec.build(self.members, same=self.same, spread=self.spread,
                       strategy=self.strategy)  # the policy's own refusals


QueueTimeoutSeconds = Annotated[int, Meta(ge=1, le=366 * 86_400)]
# a tenant's lease requests a second in a pool, and how many may come at once
RequestRate = Annotated[int, Meta(ge=1, le=1_000_000)]
RequestBurst = Annotated[int, Meta(ge=1, le=1_000_000)]


class LeaseRequest(CommandBase, frozen=True, kw_only=True):
    """Ask a pool for a time-bounded lease on capacity of the given shape."""

    pool_id: SubjectToken
    shape: ResourceShape
    maximum_runtime_seconds: RuntimeSeconds
    idempotency_key: IdempotencyKey
    priority_class: NameToken = "standard"
    image: ImageRef | None = None
    image_signature: ImageSignature | None = None
    image_size_bytes: ImageSizeBytes | None = None
    command: Command = []
    env: Environment = {}
    checkpointable: bool = False
    # When preempted, go back to the queue (True) instead of ending as preempted (False).
    preemptible_requeue: bool = False
    # Leases asked for at once (as `sbatch --array`): ids derive from the key and the index,
    # and all are accepted in one atomic save (two events each, under the batch limit).
    count: Annotated[int, Meta(ge=1, le=MAX_LEASES_PER_REQUEST)] = 1
    # An advance reservation of this tenant in this pool whose capacity it may use while the
    # reservation's window is open (`pool admin reservation create`).
    reservation_id: SubjectToken | None = None
    # a gang of leases placed together (then `count` stays 1): their ids follow from the key
    # and the member index as `count`'s do
    group: LeaseGroup | None = None
    # How long it may wait queued before it ends `queue_timeout` (left out: the pool's
    # queue_timeout_seconds, which is also the most it may ask for).
    queue_timeout_seconds: QueueTimeoutSeconds | None = None
    # what the tenant calls it: shown in lists and filtered by (`?name=`, `?label=k=v`)
    name: LeaseName | None = None
    labels: Annotated[dict[LabelKey, LabelValue], Meta(max_length=MAX_LEASE_LABELS)] = {}
    # run again when an attempt ends badly (not for a gang, which requeues whole)
    retries: RetryPolicy | None = None
    # existing leases of the tenant it waits for: held, not queued, until they ended as asked
    after: Annotated[list[LeaseDependency], Meta(max_length=MAX_DEPENDENCIES)] = []
    # another array of the same size, named by its first lease: lease i waits for its lease i
    after_each: LeaseDependency | None = None
    # of a batch (`count`): at most this many of its leases reserved or running at once
    max_running: Annotated[int, Meta(ge=1, le=MAX_LEASES_PER_REQUEST)] | None = None

    def __post_init__(self) -> None:
        if self.group is not None and self.count != 1:
            raise ValueError("a request is a gang (group) or a batch (count), not both")
        if self.group is not None and (self.retries is not None or self.after
                                       or self.after_each is not None
                                       or self.max_running is not None):
            raise ValueError("a gang (group) takes no retries, after, after_each or "
                             "max_running")


class CheckpointPolicy(PartBase, frozen=True, kw_only=True):
    """When the workload checkpoints, so preemption can pick the cheapest victim."""

    mode: CheckpointMode = "none"
    interval_seconds: Annotated[int, Meta(ge=0, le=86_400)] = 0

    def __post_init__(self) -> None:
        if self.mode == "periodic" and self.interval_seconds == 0:
            raise ValueError("mode 'periodic' requires interval_seconds >= 1")


class WorkdirRef(PartBase, frozen=True, kw_only=True):
    """A work directory packed and stored in the tenant's bucket: only its digest and size
    travel; the agent fetches it by digest and unpacks it as the job's /work."""

    digest: WorkdirDigest
    size_bytes: Annotated[int, Meta(ge=0, le=MAX_WORKDIR_BYTES)]
    files: Count = 0


class JobSpec(PartBase, frozen=True, kw_only=True):
    """The workload that runs on a committed lease; unset fields fall back to the request's."""

    image: ImageRef | None = None
    image_signature: ImageSignature | None = None
    image_size_bytes: ImageSizeBytes | None = None
    command: Command = []
    env: Environment = {}
    checkpoint_policy: CheckpointPolicy = msgspec.field(default_factory=CheckpointPolicy)
    workdir: WorkdirRef | None = None
    artifacts: Annotated[list[ArtifactGlob], Meta(max_length=MAX_ARTIFACT_GLOBS)] = []
    # the tenant's secrets by name, never values (`env` is public: it is in the log): variables
    # (VAR -> name), files (name -> path under /run/secrets), the docker pull's user:password
    secret_env: Annotated[dict[EnvName, SecretName], Meta(max_length=MAX_JOB_SECRETS)] = {}
    secret_files: Annotated[dict[SecretName, SecretPath], Meta(max_length=MAX_JOB_SECRETS)] = {}
    registry_secret: SecretName | None = None
    # the version of each named secret the job gets: set by the plane at commit (what a
    # client sends is replaced)
    secret_versions: Annotated[dict[SecretName, Count], Meta(max_length=2 * MAX_JOB_SECRETS)] = {}
    # the pool's volumes the job mounts: name -> where in the sandbox (never a host path)
    volumes: Annotated[dict[VolumeName, VolumeTarget], Meta(max_length=MAX_JOB_VOLUMES)] = {}
    stdin: bool = False  # a pipe `pool lease attach -i` writes to; otherwise /dev/null

    def __post_init__(self) -> None:
        from domain.volumes import target_problem

        for name, target in self.volumes.items():
            problem = target_problem(target)
            if problem:
                raise ValueError(f"volumes {name}: {problem}")
        if len(set(self.volumes.values())) != len(self.volumes):
            raise ValueError("volumes: two volumes at one path")
        clash = sorted(v for v in self.secret_env if v in self.env or v.startswith("POOL_"))
        if clash:
            raise ValueError(f"secret_env {clash[0]!r}: a variable named in env too, or a "
                             "POOL_ one the pool sets")
        if len(set(self.secret_files.values())) != len(self.secret_files):
            raise ValueError("secret_files: two secrets at one path")


class CommitLease(CommandBase, frozen=True, kw_only=True):
    """Confirm a reserved lease and attach the job to run; an uncommitted lease times out."""

    job: JobSpec = msgspec.field(default_factory=JobSpec)


class HeartbeatLease(CommandBase, frozen=True, kw_only=True):
    """Prove the lease holder is alive; the epoch fences out a stale holder."""

    epoch: Count
    last_checkpoint_at: UnixSeconds | None = None
    utilization: Utilization | None = None


class RenewLease(CommandBase, frozen=True, kw_only=True):
    """Extend a lease's deadline to now + extend_seconds (left out: the lease's term), never
    past its maximum runtime."""

    extend_seconds: RuntimeSeconds | None = None


class ReleaseLease(CommandBase, frozen=True, kw_only=True):
    """Give capacity back: the holder is done with it."""

    exit_code: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    reason: Reason | None = None


class CancelLease(CommandBase, frozen=True, kw_only=True):
    """Withdraw a request or stop a lease before it completes."""

    reason: Reason | None = None


