"""Pool-wide policy (`Pool`) and each tenant's weight and quota in a pool (`TenantPolicy`).
Versioned settings and prices: docs/architecture.md#pools-prices-and-credits.
"""

from __future__ import annotations

import functools
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.errors import (
    ImageNotAllowed,
    InvalidConfiguration,
    PriceNotListed,
    PriorityClassNotAllowed,
    QueueLimitExceeded,
    QuotaExceeded,
    RateLimited,
    RuntimeLimitExceeded,
    UnknownPriorityClass,
    VoidedReservationLimit,
    WorkdirTooLarge,
)
from domain.policy.images import ImagePolicy, check_image, check_runtime
from domain.quota import (
    Limits,
    TenantQuota,
    exceeded,
    limit_problems,
    limits,
    limits_from_event,
    limits_to_dict,
)
from domain.rate import TokenBucket
from domain.resources import PoolId, Resources, Shape, TenantId
from domain.snapshots import StateSnapshot
from domain.volumes import Volume, admit_volumes, volumes_from_dict

_POOL_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:pool")
_TENANT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:tenant-policy")
_IDS_CACHED = 4096  # pool and tenant-policy ids remembered (a name's uuid5 costs a hash)

PACKING_POLICIES: tuple[str, ...] = ("best-fit", "spread")
QuotaLike = Mapping[str, int] | Resources | Limits | None  # see domain.quota.limits
FALLBACK = "*"  # price-table key used for a GPU model or partition profile not listed


# Value objects --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreemptionSettings:
    enabled: bool = False
    min_runtime_seconds: int = 0  # a victim must have run this long in its placement
    grace_seconds: int = 30  # time a victim gets to checkpoint and stop

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "min_runtime_seconds": self.min_runtime_seconds,
            "grace_seconds": self.grace_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreemptionSettings:
        return cls(
            enabled=bool(d.get("enabled", False)),
            min_runtime_seconds=int(d.get("min_runtime_seconds", 0)),
            grace_seconds=int(d.get("grace_seconds", 30)),
        )


@dataclass(frozen=True)
class PoolConfig:
    """A pool's scheduling and lifecycle settings. Higher priority rank = more important."""

    packing: str = "best-fit"
    commit_timeout_seconds: int = 30
    heartbeat_timeout_seconds: int = 30
    # capped at each lease's maximum runtime: by default a commit grants the whole of it
    default_lease_seconds: int = 30 * 24 * 3600
    maximum_runtime_seconds: int = 86_400  # the longest runtime a request may ask for
    priority_classes: tuple[tuple[str, int], ...] = (("default", 0),)  # sorted (name, rank)
    default_priority_class: str = "default"
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    aging_seconds_per_rank: int = 0  # waiting this long raises effective rank by 1; 0: none
    node_timeout_seconds: int = 30  # a node silent this long is lost: no new placements
    # a lost node's leases are released without the agent's word only after this long
    lost_node_release_seconds: int = 300
    # leases of these priority classes are never preemption victims
    non_preemptible_classes: tuple[str, ...] = ()
    # fair share counts usage decayed with this half-life besides current usage; 0: current only
    fair_share_half_life_seconds: int = 0
    # the user's files: the largest packed work directory a job may bring, how long a job's
    # artifacts are kept, and how many bytes of them one job may store
    max_workdir_bytes: int = 1 << 30
    artifact_ttl_seconds: int = 7 * 86_400
    max_artifact_bytes: int = 1 << 30
    # a renewal is recorded only when it moves the deadline at least this far (the log grows
    # with real changes only; domain.lease.Lease.renew)
    renew_step_seconds: int = 60
    # the most leases one tenant may have waiting in the pool's queue (the scheduler's memory)
    max_queued_leases: int = 10_000
    # how long a lease may wait queued before it ends `queue_timeout` (a request may ask less)
    queue_timeout_seconds: int = 7 * 86_400
    # a tenant's lease requests in the pool: this many a second, after a burst of this many
    # (a token bucket per command-service process)
    requests_per_second: int = 200
    request_burst: int = 1000
    # a tenant that let this many reservations time out uncommitted within the window has its
    # new requests refused until the oldest leaves it (0: no limit; docs/adr/020-…)
    max_voided_reservations: int = 20
    voided_reservation_window_seconds: int = 3600
    # host paths offered to jobs by name (domain.volumes), by name
    volumes: tuple[Volume, ...] = ()

    def __post_init__(self) -> None:
        classes = tuple(sorted((str(k), int(v)) for k, v in dict(self.priority_classes).items()))
        object.__setattr__(self, "priority_classes", classes)
        object.__setattr__(self, "non_preemptible_classes",
                           tuple(sorted({str(c) for c in self.non_preemptible_classes})))

    def class_preemptible(self, priority_class: str) -> bool:
        return priority_class not in self.non_preemptible_classes

    def problems(self) -> list[str]:
        """Every inconsistency, as reason strings; empty when the config is valid."""
        found = []
        if self.packing not in PACKING_POLICIES:
            found.append(f"packing must be one of {', '.join(PACKING_POLICIES)}")
        for name in ("commit_timeout_seconds", "heartbeat_timeout_seconds",
                     "default_lease_seconds", "maximum_runtime_seconds",
                     "node_timeout_seconds", "lost_node_release_seconds"):
            if getattr(self, name) <= 0:
                found.append(f"{name} must be positive")
        if self.aging_seconds_per_rank < 0:
            found.append("aging_seconds_per_rank must not be negative")
        if not self.priority_classes:
            found.append("at least one priority class is required")
        if self.default_priority_class not in dict(self.priority_classes):
            found.append(f"default priority class {self.default_priority_class!r} is not defined")
        if self.preemption.min_runtime_seconds < 0 or self.preemption.grace_seconds < 0:
            found.append("preemption times must not be negative")
        for name in self.non_preemptible_classes:
            if name not in dict(self.priority_classes):
                found.append(f"non-preemptible class {name!r} is not defined")
        if self.fair_share_half_life_seconds < 0:
            found.append("fair_share_half_life_seconds must not be negative")
        for name in ("max_workdir_bytes", "max_artifact_bytes"):
            if getattr(self, name) < 0:
                found.append(f"{name} must not be negative")
        if self.artifact_ttl_seconds <= 0:
            found.append("artifact_ttl_seconds must be positive")
        if self.renew_step_seconds < 0:
            found.append("renew_step_seconds must not be negative")
        if self.max_queued_leases <= 0:
            found.append("max_queued_leases must be positive")
        if self.queue_timeout_seconds <= 0:
            found.append("queue_timeout_seconds must be positive")
        for name in ("requests_per_second", "request_burst"):
            if getattr(self, name) <= 0:
                found.append(f"{name} must be positive")
        if self.max_voided_reservations < 0:
            found.append("max_voided_reservations must not be negative")
        if self.voided_reservation_window_seconds <= 0:
            found.append("voided_reservation_window_seconds must be positive")
        for volume in self.volumes:
            found += volume.problems()
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "packing": self.packing,
            "commit_timeout_seconds": self.commit_timeout_seconds,
            "heartbeat_timeout_seconds": self.heartbeat_timeout_seconds,
            "default_lease_seconds": self.default_lease_seconds,
            "maximum_runtime_seconds": self.maximum_runtime_seconds,
            "priority_classes": {k: v for k, v in self.priority_classes},
            "default_priority_class": self.default_priority_class,
            "preemption": self.preemption.to_dict(),
            "aging_seconds_per_rank": self.aging_seconds_per_rank,
            "node_timeout_seconds": self.node_timeout_seconds,
            "lost_node_release_seconds": self.lost_node_release_seconds,
            "non_preemptible_classes": list(self.non_preemptible_classes),
            "fair_share_half_life_seconds": self.fair_share_half_life_seconds,
            "max_workdir_bytes": self.max_workdir_bytes,
            "artifact_ttl_seconds": self.artifact_ttl_seconds,
            "max_artifact_bytes": self.max_artifact_bytes,
            "renew_step_seconds": self.renew_step_seconds,
            "max_queued_leases": self.max_queued_leases,
            "queue_timeout_seconds": self.queue_timeout_seconds,
            "requests_per_second": self.requests_per_second,
            "request_burst": self.request_burst,
            "max_voided_reservations": self.max_voided_reservations,
            "voided_reservation_window_seconds": self.voided_reservation_window_seconds,
            # only when offered, so a pool without volumes records the same event as before
            **({"volumes": {v.name: v.to_dict() for v in self.volumes}} if self.volumes else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolConfig:
        default = cls()
        return cls(
            packing=str(d.get("packing", default.packing)),
            commit_timeout_seconds=int(d.get("commit_timeout_seconds", 30)),
            heartbeat_timeout_seconds=int(d.get("heartbeat_timeout_seconds", 30)),
            default_lease_seconds=int(d.get("default_lease_seconds", 300)),
            maximum_runtime_seconds=int(d.get("maximum_runtime_seconds", 86_400)),
            priority_classes=tuple(dict(d.get("priority_classes", {"default": 0})).items()),
            default_priority_class=str(d.get("default_priority_class", "default")),
            preemption=PreemptionSettings.from_dict(dict(d.get("preemption", {}))),
            aging_seconds_per_rank=int(d.get("aging_seconds_per_rank", 0)),
            node_timeout_seconds=int(d.get("node_timeout_seconds", 30)),
            lost_node_release_seconds=int(d.get("lost_node_release_seconds", 300)),
            non_preemptible_classes=tuple(d.get("non_preemptible_classes", ())),
            fair_share_half_life_seconds=int(d.get("fair_share_half_life_seconds", 0)),
            max_workdir_bytes=int(d.get("max_workdir_bytes", default.max_workdir_bytes)),
            artifact_ttl_seconds=int(d.get("artifact_ttl_seconds",
                                           default.artifact_ttl_seconds)),
            max_artifact_bytes=int(d.get("max_artifact_bytes", default.max_artifact_bytes)),
            renew_step_seconds=int(d.get("renew_step_seconds", default.renew_step_seconds)),
            max_queued_leases=int(d.get("max_queued_leases", default.max_queued_leases)),
            queue_timeout_seconds=int(d.get("queue_timeout_seconds",
                                            default.queue_timeout_seconds)),
            requests_per_second=int(d.get("requests_per_second", default.requests_per_second)),
            request_burst=int(d.get("request_burst", default.request_burst)),
            max_voided_reservations=int(d.get("max_voided_reservations",
                                              default.max_voided_reservations)),
            voided_reservation_window_seconds=int(d.get(
                "voided_reservation_window_seconds", default.voided_reservation_window_seconds)),
            volumes=volumes_from_dict(d.get("volumes")),
        )


# Prices are per second of one unit; resources come in millis / MiB, so the sum is kept over a
# common denominator and divided (rounding up) once, never per term.
_CPU_UNIT = 1000  # millis per core
_MEMORY_UNIT = 1024  # MiB per GiB
_DENOMINATOR = _CPU_UNIT * _MEMORY_UNIT


@dataclass(frozen=True)
class PriceList:
    """Micro-credits per second: per core (1000 cpu_millis), per GiB of memory, per GiB of local
    disk, per whole GPU by model and per GPU partition by profile ("*" prices any unlisted)."""

    cpu_core_second: int = 0
    memory_gib_second: int = 0
    local_disk_gib_second: int = 0
    gpu_second: tuple[tuple[str, int], ...] = ((FALLBACK, 0),)  # sorted (model, price)
    gpu_partition_second: tuple[tuple[str, int], ...] = ((FALLBACK, 0),)  # (profile, price)

    def __post_init__(self) -> None:
        for name in ("gpu_second", "gpu_partition_second"):
            table = tuple(sorted((str(k), int(v)) for k, v in dict(getattr(self, name)).items()))
            object.__setattr__(self, name, table)

    def problems(self) -> list[str]:
        prices = [self.cpu_core_second, self.memory_gib_second, self.local_disk_gib_second]
        prices += [v for _, v in self.gpu_second] + [v for _, v in self.gpu_partition_second]
        if any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in prices):
            return ["prices must be non-negative integers"]
        return []

    def gpu_price(self, model: str | None) -> int:
        """Price of one GPU-second. An unknown model (None: "any") is priced at the dearest
        listed model, so a hold made before placement still covers the charge."""
        table = dict(self.gpu_second)
        if model is None:
            if not table:
                raise PriceNotListed("no GPU prices are listed", reasons=("gpu_count",))
            return max(table.values())
        return _lookup(table, model, "gpu_count")

    def partition_price(self, profile: str) -> int:
        return _lookup(dict(self.gpu_partition_second), profile, f"gpu/{profile}")

    def charge(self, resources: Resources, seconds: float, *, gpu_model: str | None) -> int:
        """What `resources` cost for `seconds`, billed per started second, rounded up."""
        whole_seconds = max(0, math.ceil(seconds))
        numerator = (
            resources.cpu_millis * self.cpu_core_second * _MEMORY_UNIT
            + resources.memory_mib * self.memory_gib_second * _CPU_UNIT
            + resources.local_disk_gib * self.local_disk_gib_second * _DENOMINATOR
        )
        if resources.gpu_count:
            numerator += resources.gpu_count * self.gpu_price(gpu_model) * _DENOMINATOR
        for dimension, amount in resources.extended:
            if not dimension.startswith("gpu/"):
                raise PriceNotListed(f"no price for dimension {dimension}", reasons=(dimension,))
            numerator += amount * self.partition_price(dimension[4:]) * _DENOMINATOR
        return -(-numerator * whole_seconds // _DENOMINATOR)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_core_second": self.cpu_core_second,
            "memory_gib_second": self.memory_gib_second,
            "local_disk_gib_second": self.local_disk_gib_second,
            "gpu_second": {k: v for k, v in self.gpu_second},
            "gpu_partition_second": {k: v for k, v in self.gpu_partition_second},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PriceList:
        return cls(
            cpu_core_second=int(d.get("cpu_core_second", 0)),
            memory_gib_second=int(d.get("memory_gib_second", 0)),
            local_disk_gib_second=int(d.get("local_disk_gib_second", 0)),
            gpu_second=tuple(dict(d.get("gpu_second", {FALLBACK: 0})).items()),
            gpu_partition_second=tuple(dict(d.get("gpu_partition_second", {FALLBACK: 0})).items()),
        )


def _lookup(table: dict[str, int], key: str, dimension: str) -> int:
    if key in table:
        return table[key]
    if FALLBACK in table:
        return table[FALLBACK]
    raise PriceNotListed(f"no price for {dimension} {key!r}", reasons=(dimension,))


# Pool -----------------------------------------------------------------------------------------


class Pool(Aggregate):
    """A pool's settings and price list, each change an event."""

    Snapshot = StateSnapshot
    SNAPSHOT_SCHEMA = 1

    @staticmethod
    @functools.lru_cache(maxsize=_IDS_CACHED)  # every request asks; a few pools answer
    def create_id(pool_id: str) -> UUID:
        return uuid.uuid5(_POOL_NAMESPACE, str(pool_id))

    @classmethod
    def create(
        cls,
        *,
        pool_id: PoolId,
        now: float,
        config: PoolConfig | None = None,
        price_list: PriceList | None = None,
    ) -> Pool:
        """A new pool; without a price list it is free (every price 0)."""
        config = config or PoolConfig()
        price_list = price_list or PriceList()
        _require_valid(config.problems() + price_list.problems())
        return cls(
            pool_id=str(pool_id),
            config=config.to_dict(),
            price_list=price_list.to_dict(),
            created_at=float(now),
        )

    def snapshot_state(self) -> dict[str, Any]:
        """The pool as plain values (domain.snapshots): settings, price list and image policy
        with their versions, and its member lists."""
        return {"pool_id": str(self.pool_id), "created_at": self.created_at,
                "config": self.config.to_dict(), "config_version": self.config_version,
                "price_list": self.price_list.to_dict(),
                "price_list_version": self.price_list_version,
                "image_policy": self.image_policy.to_dict(),
                "image_policy_version": self.image_policy_version,
                "tenants": list(self.tenants), "cohorts": list(self.cohorts),
                "reservations": list(self.reservations)}

    @staticmethod
    def restore_state(state: dict[str, Any]) -> dict[str, Any]:
        return {"pool_id": PoolId(state["pool_id"]), "created_at": state["created_at"],
                "config": PoolConfig.from_dict(state["config"]),
                "config_version": state["config_version"],
                "price_list": PriceList.from_dict(state["price_list"]),
                "price_list_version": state["price_list_version"],
                "image_policy": ImagePolicy.from_dict(state["image_policy"]),
                "image_policy_version": state["image_policy_version"],
                "tenants": tuple(state["tenants"]), "cohorts": tuple(state["cohorts"]),
                "reservations": tuple(state["reservations"])}

    @event("PoolCreated")
    def __init__(
        self, pool_id: str, config: dict[str, Any], price_list: dict[str, Any], created_at: float
    ) -> None:
        self.pool_id = PoolId(pool_id)
        self.created_at = created_at
        self.config = PoolConfig.from_dict(config)
        self.config_version = 1
        self.price_list = PriceList.from_dict(price_list)
        self.price_list_version = 1
        # every pool starts under the default image policy (shown by `pool admin pool show`)
        self.image_policy = ImagePolicy()
        self.image_policy_version = 1
        # tenants with a policy and cohorts in this pool, so `pool show` can load each one
        self.tenants: tuple[str, ...] = ()
        self.cohorts: tuple[str, ...] = ()
        self.reservations: tuple[str, ...] = ()  # advance reservations, for `reservation list`

    def configure(self, config: PoolConfig, now: float) -> None:
        """Replace the pool's settings as a whole (the event carries the full config)."""
        _require_valid(config.problems())
        self._configured(config=config.to_dict(), version=self.config_version + 1, at=float(now))

    def set_price_list(self, price_list: PriceList, now: float) -> int:
        """Publish new prices; returns the price list version that holds should cite."""
        _require_valid(price_list.problems())
        self._price_list_set(
            price_list=price_list.to_dict(), version=self.price_list_version + 1, at=float(now)
        )
        return self.price_list_version

    def set_image_policy(self, policy: ImagePolicy, now: float) -> int:
        """Replace the image policy as a whole; returns its new version."""
        _require_valid(policy.problems())
        self._image_policy_set(
            policy=policy.to_dict(), version=self.image_policy_version + 1, at=float(now)
        )
        return self.image_policy_version

    def list_member(self, kind: str, name: str, now: float) -> bool:
        """Note a tenant ("tenant"), cohort ("cohort") or advance reservation ("reservation")
        configured in this pool; False when it was listed already (nothing recorded)."""
        if kind not in ("tenant", "cohort", "reservation"):
            raise InvalidConfiguration(f"unknown pool member kind {kind!r}", reasons=(kind,))
        if name in getattr(self, f"{kind}s", ()):
            return False
        self._member_listed(kind=kind, name=str(name), at=float(now))
        return True

    # Policy queries ---------------------------------------------------------------------------

    def admit_image(
        self,
        image: str | None,
        *,
        signature: str | None = None,
        size_bytes: int | None = None,
        tenant: str | None = None,
        node_trust: str | None = None,
        isolation: str | None = None,
    ) -> None:
        """Raise ImageNotAllowed, with every reason code, when the image policy refuses the job
        (no image: only the isolation check; no node yet: only the tenant's requirement)."""
        policy = self.image_policy
        if image:
            reasons = check_image(policy, image, signature, size_bytes, tenant,
                                  node_trust=node_trust, isolation=isolation)
        elif isolation is not None:
            reasons = check_runtime(policy, isolation=isolation, node_trust=node_trust,
                                    tenant=tenant)
        else:
            reasons = []
        if reasons:
            raise ImageNotAllowed(reasons, image=image or "")

    def admit_runtime(self, maximum_runtime_seconds: int) -> None:
        """Raise RuntimeLimitExceeded, naming the pool's limit in seconds and hours, when a
        request asks for a longer maximum runtime than the pool allows."""
        limit = self.config.maximum_runtime_seconds
        if maximum_runtime_seconds > limit:
            raise RuntimeLimitExceeded(
                f"maximum_runtime_seconds {maximum_runtime_seconds} s is past pool "
                f"{self.pool_id}'s maximum runtime of {limit} s ({limit / 3600:g} h)",
                reasons=("maximum_runtime_seconds",),
            )

    def admit_volumes(self, wanted: tuple[tuple[str, str], ...], node_trust: str | None) -> None:
        """Raise VolumeUnknown or VolumeNotAllowed (domain.volumes) for a job's volumes."""
        if wanted:
            admit_volumes(self.config.volumes, wanted, node_trust, pool_id=str(self.pool_id))

    def admit_workdir(self, size_bytes: int | None) -> None:
        """Raise WorkdirTooLarge, naming the pool's limit, when a job's packed work directory
        is bigger than the pool allows."""
        limit = self.config.max_workdir_bytes
        if size_bytes is not None and size_bytes > limit:
            raise WorkdirTooLarge(
                f"the work directory is {size_bytes} bytes packed, past pool {self.pool_id}'s "
                f"max_workdir_bytes of {limit} ({limit / 2**20:g} MiB)",
                reasons=("max_workdir_bytes",),
            )

    def admit_queue(self, tenant: str, queued: int, count: int) -> None:
        """Raise QueueLimitExceeded, naming the limit and what is left of it, when `count`
        more leases would take a tenant with `queued` waiting past max_queued_leases."""
        limit = self.config.max_queued_leases
        if queued + count > limit:
            left = max(0, limit - queued)
            raise QueueLimitExceeded(
                f"tenant {tenant} has {queued} leases queued in pool {self.pool_id}, whose "
                f"max_queued_leases is {limit}: {left} more may queue, this request asks for "
                f"{count}", reasons=("max_queued_leases",))

    def admit_request_rate(self, tenant: str, bucket: TokenBucket, now: float) -> None:
        """Take one of the tenant's tokens from `bucket`, or raise RateLimited naming the
        pool's requests_per_second and request_burst and when a token comes back."""
        rate, burst = self.config.requests_per_second, self.config.request_burst
        wait = bucket.take(now, rate_per_second=rate, burst=burst)
        if wait > 0:
            raise RateLimited(
                f"tenant {tenant} sends lease requests to pool {self.pool_id} faster than its "
                f"requests_per_second of {rate} (request_burst {burst}): retry in {wait:.3g} s",
                rate_per_second=rate, burst=burst, retry_after_seconds=wait)

    def note_voided_reservation(self, policy: TenantPolicy | None, now: float) -> bool:
        """Record on the tenant's policy that one of its reservations timed out uncommitted
        at `now` (the last max_voided_reservations are kept); False when nothing is recorded
        (no policy, or no limit)."""
        limit = self.config.max_voided_reservations
        if policy is None or limit <= 0:
            return False
        policy.note_voided_reservation(now, keep=limit)
        return True

    def admit_after_voids(self, tenant: str, policy: TenantPolicy | None, now: float) -> None:
        """Raise VoidedReservationLimit, naming the limit, its window and when it lifts, while
        the tenant has let max_voided_reservations time out uncommitted within the window:
        holding capacity without committing is not free (docs/adr/020-…)."""
        limit = self.config.max_voided_reservations
        window = self.config.voided_reservation_window_seconds
        if policy is None or limit <= 0:
            return
        recent = [at for at in policy.voided_at if at > now - window]
        if len(recent) < limit:
            return
        lifts = recent[-limit] + window
        raise VoidedReservationLimit(
            f"tenant {tenant} let {len(recent)} reservations in pool {self.pool_id} time out "
            f"uncommitted within {window} s, the pool's max_voided_reservations is {limit}: "
            f"its new requests are refused for {lifts - now:.0f} s more",
            limit=limit, window_seconds=window, retry_after_seconds=lifts - now)

    def rank_of(self, priority_class: str) -> int:
        try:
            return dict(self.config.priority_classes)[priority_class]
        except KeyError:
            raise UnknownPriorityClass(
                f"pool {self.pool_id} has no priority class {priority_class!r}",
                reasons=(priority_class,),
            ) from None

    def admit_priority_class(self, tenant: str, priority_class: str,
                             policy: TenantPolicy | None) -> None:
        """Raise UnknownPriorityClass for a class the pool lacks, and PriorityClassNotAllowed,
        naming the classes the tenant may use, for one its policy does not grant: a tenant
        may not pick the top class to jump the queue, nor a non-preemptible one to be immune."""
        self.rank_of(priority_class)
        allowed = self.classes_allowed(policy)
        if priority_class not in allowed:
            raise PriorityClassNotAllowed(
                f"tenant {tenant} may not use priority class {priority_class!r} in pool "
                f"{self.pool_id}; it may use {', '.join(allowed)} (the operator grants others: "
                f"pool admin tenant set {tenant} --pool {self.pool_id} --priority-classes …)",
                reasons=(priority_class, *allowed))

    def classes_allowed(self, policy: TenantPolicy | None) -> tuple[str, ...]:
        """The classes a tenant may request: the pool's default, and those its policy grants."""
        granted = () if policy is None else policy.priority_classes
        return tuple(sorted({self.config.default_priority_class, *granted}))

    def effective_rank(self, priority_class: str, waited_seconds: float) -> int:
        """Rank plus one per `aging_seconds_per_rank` waited, so nothing starves forever."""
        rank = self.rank_of(priority_class)
        per_rank = self.config.aging_seconds_per_rank
        if per_rank <= 0 or waited_seconds <= 0:
            return rank
        return rank + int(waited_seconds // per_rank)

    def hold_for(self, shape: Shape, max_runtime_seconds: int) -> int:
        """Credits to hold for a lease: its shape for its whole maximum runtime, at the dearest
        GPU model when the shape does not pin one."""
        return self.price_list.charge(shape.resources, max_runtime_seconds,
                                      gpu_model=shape.gpu_model)

    def charge_for(self, shape: Shape, seconds: float, *, gpu_model: str | None = None) -> int:
        """The charge for running `shape` for `seconds` (per started second, rounded up).
        `gpu_model` is the placed node's model; without it the shape's, else the dearest."""
        return self.price_list.charge(shape.resources, seconds,
                                      gpu_model=gpu_model or shape.gpu_model)

    # Events -----------------------------------------------------------------------------------

    @event("PoolConfigured")
    def _configured(self, config: dict[str, Any], version: int, at: float) -> None:
        self.config = PoolConfig.from_dict(config)
        self.config_version = version

    @event("PriceListSet")
    def _price_list_set(self, price_list: dict[str, Any], version: int, at: float) -> None:
        self.price_list = PriceList.from_dict(price_list)
        self.price_list_version = version

    @event("PoolMemberListed")
    def _member_listed(self, kind: str, name: str, at: float) -> None:
        if kind == "tenant":
            self.tenants = (*getattr(self, "tenants", ()), name)
        elif kind == "reservation":
            self.reservations = (*getattr(self, "reservations", ()), name)
        else:
            self.cohorts = (*getattr(self, "cohorts", ()), name)

    @event("ImagePolicySet")
    def _image_policy_set(self, policy: dict[str, Any], version: int, at: float) -> None:
        self.image_policy = ImagePolicy.from_dict(policy)
        self.image_policy_version = version


# Tenant policy --------------------------------------------------------------------------------


class TenantPolicy(Aggregate):
    """A tenant's fair-share weight, quota and standing in one pool.

    `quota` is the nominal quota: limits on the dimensions it names (None: unlimited). In a
    `cohort` the tenant may borrow past it up to `borrow_limit` and lends at most `lend_limit`
    of it (domain.quota). `preemptible` False: no lease of this tenant is ever a victim."""

    @staticmethod
    @functools.lru_cache(maxsize=_IDS_CACHED)
    def create_id(pool_id: str, tenant_id: str) -> UUID:
        return uuid.uuid5(_TENANT_NAMESPACE, json.dumps([str(pool_id), str(tenant_id)]))

    @classmethod
    def set(
        cls,
        *,
        pool_id: PoolId,
        tenant_id: TenantId,
        now: float,
        weight: int = 1,
        quota: QuotaLike = None,
        borrow_limit: QuotaLike = None,
        lend_limit: QuotaLike = None,
        cohort: str | None = None,
        preemptible: bool = True,
        priority_classes: Sequence[str] = (),
    ) -> TenantPolicy:
        settings = _tenant_settings(weight, quota, borrow_limit, lend_limit, cohort, preemptible,
                                    priority_classes)
        return cls(pool_id=str(pool_id), tenant_id=str(tenant_id), set_at=float(now),
                   **settings)

    @event("TenantPolicySet")
    def __init__(
        self,
        pool_id: str,
        tenant_id: str,
        weight: int,
        quota: dict[str, Any] | None,
        set_at: float,
        borrow_limit: dict[str, Any] | None = None,  # absent from events before cohorts
        lend_limit: dict[str, Any] | None = None,
        cohort: str | None = None,
        preemptible: bool = True,
        priority_classes: list[str] | None = None,  # absent before grants: the default only
    ) -> None:
        self.pool_id = PoolId(pool_id)
        self.tenant_id = TenantId(tenant_id)
        self._apply(weight, quota, borrow_limit, lend_limit, cohort, preemptible,
                    priority_classes)
        # when its latest reservations timed out uncommitted (Pool.admit_after_voids)
        self.voided_at: tuple[float, ...] = ()

    def update(
        self,
        *,
        weight: int,
        quota: QuotaLike,
        now: float,
        borrow_limit: QuotaLike = None,
        lend_limit: QuotaLike = None,
        cohort: str | None = None,
        preemptible: bool = True,
        priority_classes: Sequence[str] = (),
    ) -> None:
        """Replace every setting together (None quota: unlimited; no priority classes: the
        pool's default class only)."""
        settings = _tenant_settings(weight, quota, borrow_limit, lend_limit, cohort, preemptible,
                                    priority_classes)
        self._updated(at=float(now), **settings)

    def note_voided_reservation(self, now: float, *, keep: int) -> None:
        """One of the tenant's reservations timed out uncommitted at `now`; the latest `keep`
        such times are remembered (Pool.note_voided_reservation)."""
        self._reservation_voided(at=float(now), keep=max(1, int(keep)))

    @property
    def limits(self) -> TenantQuota:
        """The quota as domain.quota's arithmetic reads it."""
        return TenantQuota(self.tenant_id, self.quota, self.borrow_limit, self.lend_limit,
                           self.cohort)

    def check_quota(self, in_use: Resources, requested: Resources) -> None:
        """Raise QuotaExceeded, naming the dimensions, when `in_use + requested` passes the
        nominal quota in a dimension it names."""
        over = exceeded(in_use, requested, self.quota)
        if over:
            raise QuotaExceeded(over)

    @event("TenantPolicyUpdated")
    def _updated(
        self,
        weight: int,
        quota: dict[str, Any] | None,
        at: float,
        borrow_limit: dict[str, Any] | None = None,
        lend_limit: dict[str, Any] | None = None,
        cohort: str | None = None,
        preemptible: bool = True,
        priority_classes: list[str] | None = None,
    ) -> None:
        self._apply(weight, quota, borrow_limit, lend_limit, cohort, preemptible,
                    priority_classes)

    @event("TenantReservationVoided")
    def _reservation_voided(self, at: float, keep: int) -> None:
        self.voided_at = (*getattr(self, "voided_at", ()), at)[-keep:]

    def _apply(self, weight: int, quota: dict[str, Any] | None,
               borrow_limit: dict[str, Any] | None, lend_limit: dict[str, Any] | None,
               cohort: str | None, preemptible: bool,
               priority_classes: list[str] | None) -> None:
        self.weight = weight
        self.quota = limits_from_event(quota)
        self.borrow_limit = limits_from_event(borrow_limit)
        self.lend_limit = limits_from_event(lend_limit)
        self.cohort = cohort
        self.preemptible = preemptible
        # the classes granted besides the pool's default (Pool.classes_allowed)
        self.priority_classes: tuple[str, ...] = tuple(priority_classes or ())


def _tenant_settings(weight: object, quota: QuotaLike, borrow_limit: QuotaLike,
                     lend_limit: QuotaLike, cohort: str | None,
                     preemptible: bool, priority_classes: Sequence[str]) -> dict[str, Any]:
    """The event fields for a tenant's settings, validated (InvalidConfiguration)."""
    q, b, lend = limits(quota), limits(borrow_limit), limits(lend_limit)
    found = []
    if not isinstance(weight, int) or isinstance(weight, bool) or weight <= 0:
        found.append("weight must be a positive integer")
    for name, value in (("quota", q), ("borrow limit", b), ("lend limit", lend)):
        found += limit_problems(name, value)
    if (b or lend) and cohort is None:
        found.append("borrow and lend limits need a cohort")
    if (b or lend) and q is None:
        found.append("borrow and lend limits need a nominal quota")
    _require_valid(found)
    return {"weight": weight, "quota": limits_to_dict(q), "borrow_limit": limits_to_dict(b),
            "lend_limit": limits_to_dict(lend), "cohort": cohort,
            "preemptible": bool(preemptible),
            "priority_classes": sorted({str(c) for c in priority_classes})}


def _require_valid(problems: list[str]) -> None:
    if problems:
        raise InvalidConfiguration("; ".join(problems), reasons=problems)
