"""Pool-wide policy (`Pool`) and each tenant's weight and quota in a pool (`TenantPolicy`).
Versioned settings and prices: docs/architecture.md#pools-prices-and-credits.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.errors import (
    AttemptLimitExceeded,
    ImageNotAllowed,
    InvalidConfiguration,
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
from domain.poolconfig import PoolConfig
from domain.prices import PriceList
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
from domain.volumes import admit_volumes

_POOL_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:pool")
_TENANT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:tenant-policy")
_IDS_CACHED = 4096  # pool and tenant-policy ids remembered (a name's uuid5 costs a hash)

QuotaLike = Mapping[str, int] | Resources | Limits | None  # see domain.quota.limits


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

    def admit_attempts(self, max_attempts: int) -> None:
        """Raise AttemptLimitExceeded when a retry policy asks for more attempts than the
        pool's max_attempts."""
        limit = self.config.max_attempts
        if max_attempts > limit:
            raise AttemptLimitExceeded(
                f"retries.max_attempts {max_attempts} is past pool {self.pool_id}'s "
                f"max_attempts of {limit}", reasons=("max_attempts",))

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
