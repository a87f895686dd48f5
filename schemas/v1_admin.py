"""Version 1's operator bodies: pool policy and its patch, tenants and cohorts, reservations,
prices, image policy, credits and node enrollment.
"""

# msgspec gives each instance its own copy of a mutable default; ruff sees that only when
# msgspec.Struct is a base in the same file, not through the imported bases.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.hostaccess import (
    MAX_EGRESS_ALLOW,
    MAX_POOL_VOLUMES,
    EgressCidr,
    TrustLevel,
    VolumeConfig,
    VolumeName,
)
from schemas.v1_leases import (
    MAX_ATTEMPTS_LIMIT,
    QueueTimeoutSeconds,
    RequestBurst,
    RequestRate,
)
from schemas.v1_resources import ResourceAmounts
from schemas.v1_vocabulary import (
    MAX_IMAGE_SIZE_BYTES,
    MAX_RUNTIME_SECONDS,
    MAX_WORKDIR_BYTES,
    MIG_PROFILE_PATTERN,
    CommandBase,
    Count,
    GpuModel,
    NameToken,
    OutputBytes,
    PackingPolicy,
    PartBase,
    PublicKeyPem,
    Reason,
    RegistryPattern,
    RuntimeClass,
    RuntimeSeconds,
    ShortText,
    SubjectToken,
)


class PreemptionPolicy(PartBase, frozen=True, kw_only=True):
    """Whether higher priority work may evict lower, and how gently."""

    enabled: bool = False
    # A victim must have run this long, so preemption cannot thrash a job that just started.
    min_runtime_seconds: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] = 0
    grace_seconds: Annotated[int, Meta(ge=0, le=3600)] = 30


class PoolConfig(CommandBase, frozen=True, kw_only=True):
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


class PreemptionPatch(PartBase, frozen=True, kw_only=True):
    """The preemption settings to change; a field left out (null) keeps its value."""

    enabled: bool | None = None
    min_runtime_seconds: Annotated[int, Meta(ge=0, le=MAX_RUNTIME_SECONDS)] | None = None
    grace_seconds: Annotated[int, Meta(ge=0, le=3600)] | None = None


class PoolPatch(CommandBase, frozen=True, kw_only=True):
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


class TenantConfig(CommandBase, frozen=True, kw_only=True):
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


class CohortConfig(CommandBase, frozen=True, kw_only=True):
    """A cohort of tenants in a pool: its own shared nominal quota, and whether an owner may
    preempt borrowers to reclaim its nominal quota ("any") or only waits ("never")."""

    pool_id: SubjectToken
    name: SubjectToken
    nominal: QuotaLimits = {}
    reclaim: Literal["any", "never"] = "any"


class ReservationCreate(CommandBase, frozen=True, kw_only=True):
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


class ReservationDelete(CommandBase, frozen=True, kw_only=True):
    """Withdraw a reservation: its capacity returns to everyone at once."""

    pool_id: SubjectToken
    reservation_id: SubjectToken


class ReservationList(CommandBase, frozen=True, kw_only=True):
    """A pool's reservations; ended and deleted ones only with `all`."""

    pool_id: SubjectToken
    all: bool = False


MicroCredits = Annotated[int, Meta(ge=0, le=10**12)]


class PriceListConfig(CommandBase, frozen=True, kw_only=True):
    """A pool's prices in micro-credits per second; each change is a new price-list version."""

    pool_id: SubjectToken
    cpu_core_second: MicroCredits = 0
    memory_gib_second: MicroCredits = 0
    local_disk_gib_second: MicroCredits = 0
    # by GPU model, and by partition profile; "*" prices anything unlisted
    gpu_second: Annotated[dict[ShortText, MicroCredits], Meta(max_length=64)] = {}
    gpu_partition_second: Annotated[dict[ShortText, MicroCredits], Meta(max_length=64)] = {}


class TrustedKey(PartBase, frozen=True, kw_only=True):
    """A public key image signatures may verify under, named by a key id."""

    key_id: NameToken
    public_key_pem: PublicKeyPem


RegistryList = Annotated[list[RegistryPattern], Meta(max_length=64)]


class ImagePolicyConfig(CommandBase, frozen=True, kw_only=True):
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


class PoolShow(CommandBase, frozen=True, kw_only=True):
    """Ask for every setting in force for a pool."""

    pool_id: SubjectToken


class CreditGrant(CommandBase, frozen=True, kw_only=True):
    """Add credits to a tenant's account; a repeated transfer id changes nothing."""

    tenant: SubjectToken
    amount_microcredits: Annotated[int, Meta(gt=0, le=10**15)]
    transfer_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,128}(?!\n)$")]
    reason: Reason | None = None


class NodeEnrollment(CommandBase, frozen=True, kw_only=True):
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


class NodeStateChange(CommandBase, frozen=True, kw_only=True):
    """Cordon, drain, put in maintenance or return a node (the verb is in the subject)."""

    reason: Reason | None = None


