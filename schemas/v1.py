"""Version 1 of the wire types: commands, admin bodies, agent messages, telemetry and replies.
Units, bounds and unknown fields: docs/architecture.md#wire-types-and-their-evolution.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from domain.devices import Device, inventory_problems
from domain.gang import MAX_GANG_MEMBERS
from domain.policy.gang import GangSpec
from domain.resources import NodeCapabilities, Resources, Shape, partition_dimension
from schemas.hostaccess import (  # noqa: F401 (VolumeName, HostPath: part of this version)
    MAX_EGRESS_ALLOW,
    MAX_JOB_VOLUMES,
    MAX_POOL_VOLUMES,
    EgressCidr,
    HostPath,
    TrustLevel,
    VolumeConfig,
    VolumeMount,
    VolumeName,
    VolumeTarget,
)

# -- bounds ------------------------------------------------------------------------------------
# Sane maxima: far above any real machine, low enough that arithmetic on sums never surprises.

MAX_CPU_MILLIS = 1_024_000  # 1024 cores
MAX_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB
MAX_GPU_COUNT = 64
MAX_GPU_MEMORY_GIB = 1024
MAX_LOCAL_DISK_GIB = 1_000_000
MAX_BANDWIDTH_MBPS = 1_000_000  # 1 Tbit/s
MAX_RUNTIME_SECONDS = 30 * 24 * 3600  # 30 days
MAX_PREFERENCES = 16
MAX_IMAGE_SIZE_BYTES = 1 << 40  # 1 TiB
MAX_LEASES_PER_REQUEST = 999  # one event each: one atomic batch holds at most 1,000
MAX_WORKDIR_BYTES = 1 << 40  # 1 TiB: the most any pool may set as its workdir limit
# a job's output kept on its node and shipped to its tenant (pool setting max_output_bytes)
OutputBytes = Annotated[int, Meta(ge=0, le=1 << 34)]
MAX_ARTIFACT_GLOBS = 32

CURRENT_SCHEMA_VERSION = 1

# -- scalar vocabulary -------------------------------------------------------------------------
# Patterns end in (?!\n)$ because msgspec matches with Python's re, where a bare $ also matches
# before a trailing newline ("gpu\n" would pass as a subject token); ECMA readers of the exported
# JSON Schema accept the lookahead too.

# A reader accepts the versions it knows; a body from a newer writer is refused, not guessed at.
SchemaVersion = Annotated[
    int,
    Meta(ge=1, le=CURRENT_SCHEMA_VERSION, description="Wire schema version of this message."),
]

# Ids that become NATS subject tokens: exactly bus.subjects' token alphabet, so that
# `token(id) == id` and no two ids share a subject.
SubjectToken = Annotated[
    str, Meta(pattern=r"^[a-z0-9_-]{1,128}(?!\n)$", min_length=1, max_length=128)
]
# Names chosen by operators (priority classes, regions, zones): subject-safe as well.
NameToken = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}(?!\n)$", max_length=63)]
# Client-chosen keys that never become subjects: a wider but still printable alphabet.
IdempotencyKey = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}(?!\n)$",
        min_length=1,
        max_length=128,
        description="Client-chosen key; a retry with the same key returns the same lease.",
    ),
]
# NVML names contain spaces and parentheses ("NVIDIA H100 80GB HBM3"), so printable ASCII.
GpuModel = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][ -~]{0,127}(?!\n)$", max_length=128)]
ImageRef = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}(?!\n)$",
        max_length=512,
        description="OCI image reference; a digest (`@sha256:...`) pins it immutably.",
    ),
]
ImageSignature = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9+/]{4,2048}={0,2}(?!\n)$",
        max_length=2050,
        description="Base64 signature over the image's cosign simple-signing payload "
        "(DER ECDSA P-256/SHA-256, or raw Ed25519).",
    ),
]
ImageSizeBytes = Annotated[
    int,
    Meta(ge=0, le=MAX_IMAGE_SIZE_BYTES, description="Image size in bytes, as declared by the job."),
]
# `*`, a registry `host[:port]`, or `host[:port]/repository-prefix`.
RegistryPattern = Annotated[
    str,
    Meta(
        pattern=r"^(\*|[a-z0-9]([a-z0-9.-]{0,252}[a-z0-9])?(:[0-9]{1,5})?"
        r"(/[a-z0-9._-]{1,128}){0,16})(?!\n)$",
        max_length=512,
    ),
]
PublicKeyPem = Annotated[
    str,
    Meta(
        pattern=r"^-----BEGIN PUBLIC KEY-----\r?\n([A-Za-z0-9+/=]{1,80}\r?\n){1,64}"
        r"-----END PUBLIC KEY-----(\r?\n)?(?!\n)$",
        max_length=8192,
        description="PEM SubjectPublicKeyInfo: an ECDSA P-256 or Ed25519 public key.",
    ),
]
# a packed work directory's name in the tenant's bucket: the SHA-256 of its bytes
WorkdirDigest = Annotated[
    str,
    Meta(pattern=r"^sha256:[0-9a-f]{64}(?!\n)$", max_length=71,
         description="SHA-256 of the packed work directory (a tar), as `sha256:<hex>`."),
]
# relative to /work; no control characters, no leading `/`
ArtifactGlob = Annotated[
    str,
    Meta(pattern=r"^[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]{0,255}(?!\n)$", max_length=256,
         description="A glob of files, relative to /work, stored as artifacts at the job's end."),
]
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}(?!\n)$", max_length=128)]
# a tenant's secret (schemas/secret.py); its value never travels in a job, only its name
SecretName = Annotated[
    str,
    Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}(?!\n)$", max_length=63,
         description="A secret's name: 1-63 of a-z 0-9 _ -, starting with a letter or digit."),
]
# where a secret's file appears in the sandbox: always in the tmpfs the agent makes there
SecretPath = Annotated[
    str,
    Meta(pattern=r"^/run/secrets/(?!\.\.?$)[A-Za-z0-9._-]{1,128}(?!\n)$", max_length=141,
         description="A file under /run/secrets (in memory, wiped at the job's end)."),
]
MAX_JOB_SECRETS = 32
EnvValue = Annotated[str, Meta(max_length=4096)]
Argument = Annotated[str, Meta(max_length=4096)]
Command = Annotated[list[Argument], Meta(max_length=256)]
Environment = Annotated[dict[EnvName, EnvValue], Meta(max_length=128)]
Reason = Annotated[str, Meta(max_length=512)]
ShortText = Annotated[str, Meta(max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**53)]  # sequence numbers, epochs, quota amounts
LabelKey = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}(?!\n)$", max_length=63)]
LabelValue = Annotated[str, Meta(max_length=256)]
# a lease's name: what its tenant calls it (not unique; lists are filtered by it)
LeaseName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}(?!\n)$",
                                max_length=63)]
MAX_LEASE_LABELS = 16
UnixSeconds = Annotated[float, Meta(ge=0, le=1e11, description="Seconds since the Unix epoch.")]

CpuMillis = Annotated[int, Meta(ge=0, le=MAX_CPU_MILLIS, description="1000 = one CPU core.")]
MemoryMib = Annotated[int, Meta(ge=0, le=MAX_MEMORY_MIB)]
GpuCount = Annotated[int, Meta(ge=0, le=MAX_GPU_COUNT)]
GpuMemoryGib = Annotated[int, Meta(ge=0, le=MAX_GPU_MEMORY_GIB)]
# a GPU or MIG UUID as NVML spells it, or "<gpu uuid>/ts<k>" for a time-slice replica
DeviceId = Annotated[
    str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,119}(/ts[0-9]{1,2})?(?!\n)$",
              max_length=128)
]
MAX_DEVICES = 1024  # MIG instances and replicas included
LocalDiskGib = Annotated[int, Meta(ge=0, le=MAX_LOCAL_DISK_GIB)]
BandwidthMbps = Annotated[int, Meta(ge=0, le=MAX_BANDWIDTH_MBPS)]
RuntimeSeconds = Annotated[int, Meta(ge=1, le=MAX_RUNTIME_SECONDS)]

# A MIG profile ("1g.10gb", "7g.80gb") or "time-slice": each is its own extended dimension.
MIG_PROFILE_PATTERN = r"[1-7]g\.[1-9][0-9]{0,3}gb"
PartitionProfile = Annotated[
    str, Meta(pattern=rf"^({MIG_PROFILE_PATTERN}|time-slice)(?!\n)$", max_length=16)
]
GpuPartition = Annotated[
    str,
    Meta(
        pattern=rf"^(none|time-slice|{MIG_PROFILE_PATTERN})(?!\n)$",
        max_length=16,
        description='"none" (whole GPUs), a MIG profile such as "1g.10gb", or "time-slice".',
    ),
]

# These Literals spell the domain's vocabularies exactly (tests/unit/test_schemas.py checks).
CpuArch = Literal["amd64", "arm64"]
NetworkEgress = Literal["none", "restricted", "open"]
RuntimeClass = Literal["container", "sandboxed", "microvm", "dedicated-host"]
PreferenceKind = Literal["zone", "region", "image_cached", "gpu_model", "node_label"]
PackingPolicy = Literal["best-fit", "spread"]
CheckpointMode = Literal["none", "on-preempt", "periodic"]
# output: a chunk of a job's stdout and stderr (attrs text and job), for `pool lease logs`
TelemetryKind = Literal["queue", "startup", "execution", "utilization", "failure", "output"]

# msgspec does not inherit kw_only, so every subclass below repeats it (fields after a
# defaulted schema_version may then be required).


class _Command(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of every command body: strict (unknown fields refused) and versioned."""

    schema_version: SchemaVersion = 1


class _Part(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of nested parts: versioned with the message that carries them."""


class _Lenient(Struct, frozen=True, kw_only=True):
    """Base of replies and telemetry: readers ignore fields added by newer writers."""

    schema_version: SchemaVersion = 1


# -- resource shape ----------------------------------------------------------------------------


class NetworkSpec(_Part, frozen=True, kw_only=True):
    """Network a workload needs: the egress class it may use and a bandwidth floor."""

    egress: NetworkEgress = "none"
    bandwidth_mbps_min: BandwidthMbps = 0


class Preference(_Part, frozen=True, kw_only=True):
    """A soft preference: it affects ranking among eligible nodes, never eligibility."""

    kind: PreferenceKind
    # node_label values are "key=value"; the others are a zone, region, image ref or model.
    value: Annotated[str, Meta(min_length=1, max_length=512)]


class ResourceShape(_Part, frozen=True, kw_only=True):
    """What a lease asks for: amounts, exact pins (hard constraints) and ranked preferences."""

    schema_version: SchemaVersion = 1
    # Required, so nobody gets a hidden default amount of CPU or memory.
    cpu_millis: CpuMillis
    memory_mib: MemoryMib
    gpu_count: Annotated[
        int,
        Meta(
            ge=0,
            le=MAX_GPU_COUNT,
            description="Whole GPUs, or the number of partitions when gpu_partition is set.",
        ),
    ] = 0
    gpu_memory_gib_min: GpuMemoryGib = 0
    gpu_model: GpuModel | None = None
    cpu_arch: CpuArch | None = None
    gpu_partition: GpuPartition = "none"
    local_disk_gib: LocalDiskGib = 0
    network: NetworkSpec = msgspec.field(default_factory=NetworkSpec)
    runtime: RuntimeClass = "container"
    region: NameToken | None = None
    zone: NameToken | None = None
    preferences: Annotated[list[Preference], Meta(max_length=MAX_PREFERENCES)] = []

    def __post_init__(self) -> None:
        # Cross-field rules msgspec cannot express; the ValueError becomes a ValidationError.
        if self.gpu_partition != "none" and self.gpu_count < 1:
            raise ValueError("gpu_partition requires gpu_count >= 1 (the number of partitions)")
        if self.gpu_count == 0 and (self.gpu_memory_gib_min or self.gpu_model is not None):
            raise ValueError("gpu_memory_gib_min and gpu_model require gpu_count >= 1")

    def to_domain(self) -> Shape:
        return Shape.build(
            cpu_millis=self.cpu_millis,
            memory_mib=self.memory_mib,
            gpu_count=self.gpu_count,
            local_disk_gib=self.local_disk_gib,
            gpu_partition=self.gpu_partition,
            gpu_memory_gib_min=self.gpu_memory_gib_min,
            gpu_model=self.gpu_model,
            cpu_arch=self.cpu_arch,
            network_egress=self.network.egress,
            bandwidth_mbps_min=self.network.bandwidth_mbps_min,
            runtime=self.runtime,
            region=self.region,
            zone=self.zone,
            preferences=[(p.kind, p.value) for p in self.preferences],
        )


class ResourceAmounts(_Part, frozen=True, kw_only=True):
    """An amount of capacity: scalar dimensions plus GPU partitions counted per profile."""

    cpu_millis: CpuMillis = 0
    memory_mib: MemoryMib = 0
    gpu_count: GpuCount = 0
    local_disk_gib: LocalDiskGib = 0
    gpu_partitions: Annotated[
        dict[PartitionProfile, Annotated[int, Meta(ge=0, le=1024)]], Meta(max_length=32)
    ] = {}

    def to_domain(self) -> Resources:
        return Resources(
            cpu_millis=self.cpu_millis,
            memory_mib=self.memory_mib,
            gpu_count=self.gpu_count,
            local_disk_gib=self.local_disk_gib,
            extended=tuple((partition_dimension(p), n) for p, n in self.gpu_partitions.items()),
        )


# -- lease commands ----------------------------------------------------------------------------


TopologyKey = Literal["rack", "block", "nvlink_domain", "zone", "failure_domain"]
GangStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


RetryReason = Literal["failed", "node_lost", "heartbeat_lost", "preempted", "deadline"]
MAX_ATTEMPTS_LIMIT = 100  # the most any pool may allow (PoolConfig.max_attempts)


class RetryPolicy(_Part, frozen=True, kw_only=True):
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


class LeaseDependency(_Part, frozen=True, kw_only=True):
    """Wait for another lease of the same tenant to end: `ok` (it succeeded), `notok` (it
    ended any other way) or `any`."""

    lease_id: SubjectToken
    condition: DependencyCondition = "ok"


class LeaseGroup(_Part, frozen=True, kw_only=True):
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


class LeaseRequest(_Command, frozen=True, kw_only=True):
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


class CheckpointPolicy(_Part, frozen=True, kw_only=True):
    """When the workload checkpoints, so preemption can pick the cheapest victim."""

    mode: CheckpointMode = "none"
    interval_seconds: Annotated[int, Meta(ge=0, le=86_400)] = 0

    def __post_init__(self) -> None:
        if self.mode == "periodic" and self.interval_seconds == 0:
            raise ValueError("mode 'periodic' requires interval_seconds >= 1")


class WorkdirRef(_Part, frozen=True, kw_only=True):
    """A work directory packed and stored in the tenant's bucket: only its digest and size
    travel; the agent fetches it by digest and unpacks it as the job's /work."""

    digest: WorkdirDigest
    size_bytes: Annotated[int, Meta(ge=0, le=MAX_WORKDIR_BYTES)]
    files: Count = 0


class JobSpec(_Part, frozen=True, kw_only=True):
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


class CommitLease(_Command, frozen=True, kw_only=True):
    """Confirm a reserved lease and attach the job to run; an uncommitted lease times out."""

    job: JobSpec = msgspec.field(default_factory=JobSpec)


class Utilization(_Part, frozen=True, kw_only=True):
    """Point-in-time usage a heartbeat or telemetry sample reports; every field optional."""

    cpu_millis_used: CpuMillis | None = None
    memory_mib_used: MemoryMib | None = None
    gpu_util_percent: Annotated[float, Meta(ge=0, le=100)] | None = None
    gpu_memory_mib_used: MemoryMib | None = None


class HeartbeatLease(_Command, frozen=True, kw_only=True):
    """Prove the lease holder is alive; the epoch fences out a stale holder."""

    epoch: Count
    last_checkpoint_at: UnixSeconds | None = None
    utilization: Utilization | None = None


class RenewLease(_Command, frozen=True, kw_only=True):
    """Extend a lease's deadline to now + extend_seconds (left out: the lease's term), never
    past its maximum runtime."""

    extend_seconds: RuntimeSeconds | None = None


class ReleaseLease(_Command, frozen=True, kw_only=True):
    """Give capacity back: the holder is done with it."""

    exit_code: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    reason: Reason | None = None


class CancelLease(_Command, frozen=True, kw_only=True):
    """Withdraw a request or stop a lease before it completes."""

    reason: Reason | None = None


class GetLease(_Command, frozen=True, kw_only=True):
    """Read one lease's current state (the lease id is in the subject)."""


class WhyLease(_Command, frozen=True, kw_only=True):
    """Ask why a lease is pending (per-reason node counts); `at`: the reason recorded then."""
    at: UnixSeconds | None = None


class QueuePositions(_Command, frozen=True, kw_only=True):
    """List the tenant's waiting leases with their places in the queue and estimated starts."""


class Query(_Command, frozen=True, kw_only=True):
    """Read a projection view (named in the subject), filtered and paged; `at`: as it was then."""

    filters: Annotated[dict[NameToken, ShortText], Meta(max_length=32)] = {}
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100
    cursor: Annotated[str, Meta(max_length=256)] | None = None
    at: UnixSeconds | None = None


class TelemetryReplay(_Command, frozen=True, kw_only=True):
    """A page of the tenant's own telemetry, read by the service for it (`pool.cmd.<tenant>.
    telemetry.replay`): from `since`, or after the stream sequence `after_seq` the last page ended
    on. The tenant token is the subject's: a tenant never needs (nor gets) stream consumers."""

    since: UnixSeconds | None = None
    after_seq: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    pool: SubjectToken | None = None
    node: SubjectToken | None = None
    lease: SubjectToken | None = None
    kind: TelemetryKind | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 500


# -- admin bodies ------------------------------------------------------------------------------


class PreemptionPolicy(_Part, frozen=True, kw_only=True):
    """Whether higher priority work may evict lower, and how gently."""

    enabled: bool = False
    # A victim must have run this long, so preemption cannot thrash a job that just started.
    min_runtime_seconds: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] = 0
    grace_seconds: Annotated[int, Meta(ge=0, le=3600)] = 30


class PoolConfig(_Command, frozen=True, kw_only=True):
    """A pool's scheduling policy: packing, commit timeout, priority classes, preemption, aging."""

    pool_id: SubjectToken
    packing: PackingPolicy = "best-fit"
    commit_timeout_seconds: Annotated[int, Meta(ge=1, le=3600)] = 30
    # Name -> rank; a higher rank is served first and may preempt a lower one.
    priority_classes: Annotated[
        dict[NameToken, Annotated[int, Meta(ge=0, le=1000)]], Meta(min_length=1, max_length=32)
    ] = msgspec.field(default_factory=lambda: {"standard": 0})
    preemption: PreemptionPolicy = msgspec.field(default_factory=PreemptionPolicy)
    # Waiting this long raises a request's effective rank by one; 0 disables aging.
    aging_seconds_per_rank: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] = 0
    # A running lease whose agent is silent this long expires (then is reconciled).
    heartbeat_timeout_seconds: Annotated[int, Meta(ge=1, le=86_400)] = 30
    # The term a commit grants and a renewal extends by default, capped at each lease's maximum
    # runtime: by default the whole of it, so a job needs no renewal; a shorter term makes
    # holders renew (and lets a forgotten lease end sooner).
    default_lease_seconds: Annotated[int, Meta(ge=1, le=MAX_RUNTIME_SECONDS)] = MAX_RUNTIME_SECONDS
    # A node whose agent is silent this long is lost: no new placements, leases reconciled.
    node_timeout_seconds: Annotated[int, Meta(ge=1, le=86_400)] = 30
    # A lost node's leases are released without the agent's confirmation after this long.
    lost_node_release_seconds: Annotated[int, Meta(ge=1, le=MAX_RUNTIME_SECONDS)] = 300
    # The longest maximum_runtime_seconds a request may ask for; a longer one is refused.
    maximum_runtime_seconds: RuntimeSeconds = 86_400
    # Leases of these priority classes are never chosen as preemption victims.
    non_preemptible_classes: Annotated[list[NameToken], Meta(max_length=32)] = []
    # Fair share also counts past usage decayed with this half-life; 0: current usage only.
    fair_share_half_life_seconds: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] = 0
    # The largest packed work directory a job may bring; a bigger one is refused at commit.
    max_workdir_bytes: Annotated[int, Meta(ge=0, le=MAX_WORKDIR_BYTES)] = 1 << 30
    # How long a job's artifacts are kept in the tenant's bucket before they expire.
    artifact_ttl_seconds: Annotated[int, Meta(ge=1, le=365 * 86_400)] = 7 * 86_400
    # The most bytes of artifacts one job stores; files past it are left out and reported.
    max_artifact_bytes: Annotated[int, Meta(ge=0, le=MAX_WORKDIR_BYTES)] = 1 << 30
    # A renewal is recorded only when it moves the deadline at least this far (capped at half
    # the extension asked); one that moves it less answers ok and changes nothing.
    renew_step_seconds: Annotated[int, Meta(ge=0, le=86_400)] = 60
    # The most leases one tenant may have queued in the pool; a request past it is refused
    # (queue_limit_exceeded) and nothing is recorded.
    max_queued_leases: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000
    # How long a lease may wait queued before it ends `queue_timeout`; a request may ask for
    # less (queue_timeout_seconds), never more.
    queue_timeout_seconds: QueueTimeoutSeconds = 7 * 86_400
    # A tenant's lease requests in the pool, per command-service process: this many a second
    # after a burst of request_burst; one past them is refused (rate_limited, Retry-After).
    requests_per_second: RequestRate = 200
    request_burst: RequestBurst = 1000
    # A tenant that let this many reservations time out uncommitted within the window has
    # its new requests refused (voided_reservation_limit) until the oldest leaves it; 0: none.
    max_voided_reservations: Annotated[int, Meta(ge=0, le=1_000_000)] = 20
    voided_reservation_window_seconds: Annotated[int, Meta(ge=1, le=30 * 86_400)] = 3600
    # The most bytes of a job's output its node stores and ships to the tenant; the rest is
    # dropped, with one marker line saying so.
    max_output_bytes: OutputBytes = 64 << 20
    # The most attempts a request's retry policy may ask for (max_attempts_exceeded past it).
    max_attempts: Annotated[int, Meta(ge=1, le=MAX_ATTEMPTS_LIMIT)] = 10
    # Host paths offered to jobs by name (`--volume NAME:TARGET`), each for nodes of some
    # trust levels; a job never names a host path.
    volumes: Annotated[dict[VolumeName, VolumeConfig], Meta(max_length=MAX_POOL_VOLUMES)] = {}
    # networks its jobs with egress may reach past the denied ranges (private, link-local, …)
    egress_allow: Annotated[list[EgressCidr], Meta(max_length=MAX_EGRESS_ALLOW)] = []


class PreemptionPatch(_Part, frozen=True, kw_only=True):
    """The preemption settings to change; a field left out (null) keeps its value."""

    enabled: bool | None = None
    min_runtime_seconds: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] | None = None
    grace_seconds: Annotated[int, Meta(ge=0, le=3600)] | None = None


class PoolPatch(_Command, frozen=True, kw_only=True):
    """A change to a pool's policy: only the fields given change (a new pool takes the
    PoolConfig defaults for the rest). The fields are PoolConfig's."""

    pool_id: SubjectToken
    packing: PackingPolicy | None = None
    commit_timeout_seconds: Annotated[int, Meta(ge=1, le=3600)] | None = None
    priority_classes: Annotated[
        dict[NameToken, Annotated[int, Meta(ge=0, le=1000)]], Meta(min_length=1, max_length=32)
    ] | None = None
    preemption: PreemptionPatch | None = None
    aging_seconds_per_rank: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] | None = None
    heartbeat_timeout_seconds: Annotated[int, Meta(ge=1, le=86_400)] | None = None
    default_lease_seconds: Annotated[int, Meta(ge=1, le=MAX_RUNTIME_SECONDS)] | None = None
    node_timeout_seconds: Annotated[int, Meta(ge=1, le=86_400)] | None = None
    lost_node_release_seconds: Annotated[int, Meta(ge=1, le=MAX_RUNTIME_SECONDS)] | None = None
    maximum_runtime_seconds: RuntimeSeconds | None = None
    non_preemptible_classes: Annotated[list[NameToken], Meta(max_length=32)] | None = None
    fair_share_half_life_seconds: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] | None = None
    max_workdir_bytes: Annotated[int, Meta(ge=0, le=MAX_WORKDIR_BYTES)] | None = None
    artifact_ttl_seconds: Annotated[int, Meta(ge=1, le=365 * 86_400)] | None = None
    max_artifact_bytes: Annotated[int, Meta(ge=0, le=MAX_WORKDIR_BYTES)] | None = None
    renew_step_seconds: Annotated[int, Meta(ge=0, le=86_400)] | None = None
    max_queued_leases: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    queue_timeout_seconds: QueueTimeoutSeconds | None = None
    requests_per_second: RequestRate | None = None
    request_burst: RequestBurst | None = None
    max_voided_reservations: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None
    voided_reservation_window_seconds: Annotated[int, Meta(ge=1, le=30 * 86_400)] | None = None
    max_output_bytes: OutputBytes | None = None
    max_attempts: Annotated[int, Meta(ge=1, le=MAX_ATTEMPTS_LIMIT)] | None = None
    # the whole set of volumes, replacing the pool's ({} removes them all)
    volumes: Annotated[
        dict[VolumeName, VolumeConfig], Meta(max_length=MAX_POOL_VOLUMES)] | None = None
    # the whole allow-list, replacing the pool's ([] removes it)
    egress_allow: Annotated[list[EgressCidr], Meta(max_length=MAX_EGRESS_ALLOW)] | None = None


# Quota keys are domain dimension names: the four scalars or "gpu/<profile>".
_SCALARS = "cpu_millis|memory_mib|gpu_count|local_disk_gib"
QuotaDimension = Annotated[
    str,
    Meta(pattern=rf"^({_SCALARS}|gpu/({MIG_PROFILE_PATTERN}|time-slice))(?!\n)$", max_length=32),
]


QuotaLimits = Annotated[dict[QuotaDimension, Count], Meta(max_length=64)]


class TenantConfig(_Command, frozen=True, kw_only=True):
    """A tenant's share of a pool: fair-share weight, nominal quota, cohort and its limits."""

    tenant: SubjectToken
    pool_id: SubjectToken
    weight: Annotated[float, Meta(gt=0, le=1_000_000)] = 1.0
    # The nominal quota. Dimensions absent from it are unlimited; None means no quota at all.
    quota: QuotaLimits | None = None
    # Another name for `quota` (the Kueue word); give one of the two.
    nominal: QuotaLimits | None = None
    # The cohort whose unused nominal quota this tenant may borrow (set with cohort.set).
    cohort: SubjectToken | None = None
    # In a cohort: the most it may use past its nominal quota (absent dimensions: no cap) ...
    borrow_limit: QuotaLimits | None = None
    # ... and the most of its nominal quota others may borrow (absent dimensions: all of it).
    lend_limit: QuotaLimits | None = None
    # False: none of this tenant's leases is ever chosen as a preemption victim.
    preemptible: bool = True
    # The priority classes the tenant may request besides the pool's default class (left out:
    # the default only); a request for another is refused with priority_class_not_allowed.
    priority_classes: Annotated[list[NameToken], Meta(max_length=32)] | None = None

    def __post_init__(self) -> None:
        if self.quota is not None and self.nominal is not None:
            raise ValueError("give quota or nominal, not both")
        if (self.borrow_limit is not None or self.lend_limit is not None) and self.cohort is None:
            raise ValueError("borrow_limit and lend_limit need a cohort")


class CohortConfig(_Command, frozen=True, kw_only=True):
    """A cohort of tenants in a pool: its own shared nominal quota, and whether an owner may
    preempt borrowers to reclaim its nominal quota ("any") or only waits ("never")."""

    pool_id: SubjectToken
    name: SubjectToken
    nominal: QuotaLimits = {}
    reclaim: Literal["any", "never"] = "any"


class ReservationCreate(_Command, frozen=True, kw_only=True):
    """Withhold capacity of a pool over [start_at, start_at + duration_seconds): `count` units
    of `shape` for `tenant`'s leases that name it, or (no tenant) the whole of `node_ids` for
    a maintenance window. Times are Unix seconds."""

    pool_id: SubjectToken
    reservation_id: SubjectToken
    tenant: SubjectToken | None = None
    start_at: Annotated[float, Meta(ge=0, le=4.0e9)]
    duration_seconds: Annotated[int, Meta(ge=1, le=366 * 86_400)]
    shape: ResourceAmounts | None = None
    count: Annotated[int, Meta(ge=1, le=10_000)] = 1
    node_ids: Annotated[list[SubjectToken], Meta(max_length=1024)] = []


class ReservationDelete(_Command, frozen=True, kw_only=True):
    """Withdraw a reservation: its capacity returns to everyone at once."""

    pool_id: SubjectToken
    reservation_id: SubjectToken


class ReservationList(_Command, frozen=True, kw_only=True):
    """A pool's reservations; ended and deleted ones only with `all`."""

    pool_id: SubjectToken
    all: bool = False


class GpuDeviceSpec(_Part, frozen=True, kw_only=True):
    """One GPU device a node offers: a whole GPU, a MIG instance or a time-slice replica."""

    id: DeviceId
    kind: Literal["gpu", "mig", "replica"] = "gpu"
    model: GpuModel | None = None
    memory_mib: MemoryMib = 0
    profile: PartitionProfile | None = None  # MIG profile, or "time-slice" for a replica
    parent: DeviceId | None = None  # the GPU a MIG instance or replica is carved from
    minor: Annotated[int, Meta(ge=0, le=4095)] | None = None  # /dev/nvidia<minor>
    nvlink_domain: LabelValue | None = None
    pci_bus_id: Annotated[str, Meta(pattern=r"^[0-9A-Fa-f:.]{1,32}(?!\n)$")] | None = None

    def __post_init__(self) -> None:
        if self.kind != "gpu" and (self.profile is None or self.parent is None):
            raise ValueError(f"a {self.kind} device needs its profile and parent GPU")
        if self.kind == "replica" and self.profile != "time-slice":
            raise ValueError("a replica's profile is time-slice")
        if self.kind == "mig" and self.profile == "time-slice":
            raise ValueError("a MIG device's profile is a MIG profile")

    def to_domain(self) -> Device:
        return Device(id=self.id, kind=self.kind, model=self.model, memory_mib=self.memory_mib,
                      profile=self.profile, parent=self.parent, minor=self.minor,
                      nvlink_domain=self.nvlink_domain, pci_bus_id=self.pci_bus_id)


class NodeCapabilitiesSpec(_Part, frozen=True, kw_only=True):
    """What a node offers: allocatable capacity (after system reserve) and its traits."""

    allocatable: ResourceAmounts
    cpu_arch: CpuArch = "amd64"
    gpu_model: GpuModel | None = None
    gpu_memory_gib: GpuMemoryGib = 0
    network_egress: NetworkEgress = "none"
    bandwidth_mbps: BandwidthMbps = 0
    runtimes: Annotated[list[RuntimeClass], Meta(min_length=1, max_length=4)] = msgspec.field(
        default_factory=lambda: ["container"]
    )
    region: NameToken = "default"
    zone: NameToken = "default"
    failure_domain: NameToken = "default"
    trust_level: TrustLevel = "trusted"
    labels: Annotated[dict[LabelKey, LabelValue], Meta(max_length=64)] = {}
    image_cache: Annotated[list[ImageRef], Meta(max_length=1024)] = []
    # the concrete devices behind gpu_count and gpu_partitions: when listed, one per GPU and
    # partition offered, and every GPU lease on the node is bound to its own
    devices: Annotated[list[GpuDeviceSpec], Meta(max_length=MAX_DEVICES)] = []

    def __post_init__(self) -> None:
        if self.devices:
            problems = inventory_problems([d.to_domain() for d in self.devices],
                                          self.allocatable.to_domain())
            if problems:
                raise ValueError("devices disagree with allocatable: " + "; ".join(problems))

    def to_domain(self) -> NodeCapabilities:
        return NodeCapabilities(
            allocatable=self.allocatable.to_domain(),
            cpu_arch=self.cpu_arch,
            gpu_model=self.gpu_model,
            gpu_memory_gib=self.gpu_memory_gib,
            network_egress=self.network_egress,
            bandwidth_mbps=self.bandwidth_mbps,
            runtimes=tuple(dict.fromkeys(self.runtimes)),
            region=self.region,
            zone=self.zone,
            failure_domain=self.failure_domain,
            trust_level=self.trust_level,
            labels=tuple(sorted(self.labels.items())),
            image_cache=tuple(self.image_cache),
            devices=tuple(d.to_domain() for d in self.devices),
        )


MicroCredits = Annotated[int, Meta(ge=0, le=10**12)]


class PriceListConfig(_Command, frozen=True, kw_only=True):
    """A pool's prices in micro-credits per second; each change is a new price-list version."""

    pool_id: SubjectToken
    cpu_core_second: MicroCredits = 0
    memory_gib_second: MicroCredits = 0
    local_disk_gib_second: MicroCredits = 0
    # by GPU model, and by partition profile; "*" prices anything unlisted
    gpu_second: Annotated[dict[ShortText, MicroCredits], Meta(max_length=64)] = {}
    gpu_partition_second: Annotated[dict[ShortText, MicroCredits], Meta(max_length=64)] = {}


class TrustedKey(_Part, frozen=True, kw_only=True):
    """A public key image signatures may verify under, named by a key id."""

    key_id: NameToken
    public_key_pem: PublicKeyPem


RegistryList = Annotated[list[RegistryPattern], Meta(max_length=64)]


class ImagePolicyConfig(_Command, frozen=True, kw_only=True):
    """A pool's image policy, replaced as a whole: approved registries (per tenant where
    set), trusted signing keys, the size limit and the isolation each trust level requires."""

    pool_id: SubjectToken
    approved_registries: RegistryList = msgspec.field(default_factory=lambda: ["*"])
    # A tenant listed here uses its own list instead of the pool's.
    tenant_registries: Annotated[dict[SubjectToken, RegistryList], Meta(max_length=256)] = {}
    trusted_keys: Annotated[list[TrustedKey], Meta(max_length=16)] = []
    require_signature: bool = False
    max_image_size_bytes: Annotated[int, Meta(ge=1, le=MAX_IMAGE_SIZE_BYTES)] | None = None
    # The weakest isolation class allowed on nodes of each trust level; levels left out keep
    # the default (trusted: container, marketplace: sandboxed).
    isolation_by_trust: Annotated[dict[TrustLevel, RuntimeClass], Meta(max_length=8)] = (
        msgspec.field(default_factory=lambda: {"trusted": "container",
                                               "marketplace": "sandboxed"})
    )
    untrusted_tenants: Annotated[list[SubjectToken], Meta(max_length=1024)] = []
    untrusted_tenant_isolation: RuntimeClass = "sandboxed"

    def __post_init__(self) -> None:
        ids = [k.key_id for k in self.trusted_keys]
        if len(ids) != len(set(ids)):
            raise ValueError("trusted key ids must be unique")


class PoolShow(_Command, frozen=True, kw_only=True):
    """Ask for every setting in force for a pool."""

    pool_id: SubjectToken


class CreditGrant(_Command, frozen=True, kw_only=True):
    """Add credits to a tenant's account; a repeated transfer id changes nothing."""

    tenant: SubjectToken
    amount_microcredits: Annotated[int, Meta(gt=0, le=10**15)]
    transfer_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,128}(?!\n)$")]
    reason: Reason | None = None


class NodeEnrollment(_Command, frozen=True, kw_only=True):
    """The operator enrolls a node: the pool it may join, its trust level and the most it may
    claim. Its agent's registration is checked against this; unset CPU and memory ceilings
    leave those dimensions unchecked, GPUs default to none."""

    node_id: SubjectToken
    pool_id: SubjectToken
    trust_level: TrustLevel = "marketplace"
    max_gpus: Annotated[int, Meta(ge=0, le=1024)] = 0
    max_cpu_millis: Annotated[int, Meta(ge=0, le=10**9)] | None = None
    max_memory_mib: Annotated[int, Meta(ge=0, le=10**12)] | None = None
    gpu_model: GpuModel | None = None


class NodeStateChange(_Command, frozen=True, kw_only=True):
    """Cordon, drain, put in maintenance or return a node (the verb is in the subject)."""

    reason: Reason | None = None


# -- agent messages ----------------------------------------------------------------------------


class NodeRegistration(_Command, frozen=True, kw_only=True):
    """A node agent joins a pool and publishes its allocatable capacity and traits."""

    node_id: SubjectToken
    pool_id: SubjectToken
    capabilities: NodeCapabilitiesSpec


class LeaseBeat(_Part, frozen=True, kw_only=True):
    """One lease the agent is running, in its node heartbeat; the epoch fences old placements."""

    lease_id: SubjectToken
    epoch: Count
    last_checkpoint_at: UnixSeconds | None = None


class NodeHeartbeat(_Command, frozen=True, kw_only=True):
    """A node agent is alive; it lists the leases it runs so the pool can keep each alive, and
    reconcile the ones it no longer runs. One heartbeat is one atomic save for all of them."""

    node_id: SubjectToken
    seq: Count
    leases: Annotated[list[LeaseBeat], Meta(max_length=4096)] = []
    utilization: Utilization | None = None


class NodeDrain(_Command, frozen=True, kw_only=True):
    """A node asks to take no new leases (maintenance); running ones finish or are moved."""

    reason: Reason | None = None


class LeaseAssignment(_Command, frozen=True, kw_only=True):
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


class LeaseRevocation(_Command, frozen=True, kw_only=True):
    """The pool tells a node agent to stop a lease (preempted, cancelled or expired)."""

    lease_id: SubjectToken
    epoch: Count
    grace_seconds: Annotated[int, Meta(ge=0, le=3600)] = 30
    reason: Reason | None = None


class LeaseStopped(_Command, frozen=True, kw_only=True):
    """A node agent confirms a lease's workload is gone (after a preemption, cancel or expiry);
    only then is its capacity returned. The epoch fences a report from an older placement."""

    epoch: Count


class JobStarted(_Command, frozen=True, kw_only=True):
    """A node agent reports the lease's current job is running (its process started)."""

    epoch: Count
    job_number: Annotated[int, Meta(ge=1, le=2**31)] = 1
    startup_seconds: Annotated[float, Meta(ge=0, le=86_400)] | None = None


class JobExited(_Command, frozen=True, kw_only=True):
    """A node agent reports the lease's current job exited; the lease is released with it."""

    epoch: Count
    exit_code: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]


class JobFailed(_Command, frozen=True, kw_only=True):
    """A node agent reports the job could not run (image refused, start failed, killed)."""

    epoch: Count
    reason: Reason


# -- telemetry and replies ---------------------------------------------------------------------

AttrName = Annotated[str, Meta(min_length=1, max_length=128)]
AttrValue = (
    Annotated[str, Meta(max_length=1024)]
    | Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
    | float
    | bool
)


class TelemetryEvent(_Lenient, frozen=True, kw_only=True):
    """One queue, startup, execution, utilization or failure sample for a lease on a node."""

    kind: TelemetryKind
    at: UnixSeconds
    seq: Count = 0
    utilization: Utilization | None = None
    attrs: Annotated[dict[AttrName, AttrValue], Meta(max_length=64)] = {}


class ErrorBody(Struct, frozen=True, kw_only=True):
    """A refusal: a stable code, a one-line message, and reason counts or details."""

    code: Annotated[str, Meta(max_length=128)]
    message: Annotated[str, Meta(max_length=4096)]
    reasons: dict[str, int | str] = {}


class Envelope(_Lenient, frozen=True, kw_only=True):
    """Every reply: ok with a lease or result, or not ok with an error."""

    ok: bool
    lease: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: ErrorBody | None = None

    @classmethod
    def success(
        cls, *, lease: dict[str, Any] | None = None, result: dict[str, Any] | None = None
    ) -> Envelope:
        return cls(ok=True, lease=lease, result=result)

    @classmethod
    def failure(
        cls, code: str, message: str, reasons: dict[str, int | str] | None = None
    ) -> Envelope:
        return cls(ok=False, error=ErrorBody(code=code, message=message, reasons=reasons or {}))


# Every public Struct, in export order: each gets its own JSON Schema file.
PUBLIC_STRUCTS: tuple[type[Struct], ...] = (
    ResourceShape,
    NetworkSpec,
    Preference,
    ResourceAmounts,
    LeaseRequest,
    LeaseGroup,
    JobSpec,
    CheckpointPolicy,
    CommitLease,
    HeartbeatLease,
    Utilization,
    RenewLease,
    ReleaseLease,
    CancelLease,
    GetLease,
    WhyLease,
    QueuePositions,
    Query,
    TelemetryReplay,
    PoolConfig,
    PreemptionPolicy,
    PoolPatch,
    PreemptionPatch,
    TenantConfig,
    CohortConfig,
    ReservationCreate,
    ReservationDelete,
    ReservationList,
    PoolShow,
    PriceListConfig,
    ImagePolicyConfig,
    TrustedKey,
    CreditGrant,
    NodeEnrollment,
    NodeStateChange,
    NodeCapabilitiesSpec,
    NodeRegistration,
    NodeHeartbeat,
    NodeDrain,
    LeaseAssignment,
    LeaseRevocation,
    LeaseBeat,
    JobStarted,
    JobExited,
    JobFailed,
    LeaseStopped,
    TelemetryEvent,
    ErrorBody,
    Envelope,
)
