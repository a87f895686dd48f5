"""The admin service: the operator's pools, prices, image policy, tenants, cohorts and
capacity reservations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

from domain.account import Account
from domain.cohort import Cohort
from domain.errors import DomainError
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.policy.backfill import lease_end_estimate
from domain.pool import Pool, TenantPolicy
from domain.poolconfig import PoolConfig
from domain.prices import PriceList
from domain.quota import QuotaBook
from domain.reservation import CapacityReservation
from domain.resources import PoolId, Resources, TenantId
from schemas import v1
from schemas.convert import image_policy_from_wire, pool_config_from_wire, pool_config_patched
from workers.application.core import WEIGHT_SCALE, Store, retried
from workers.errors import (
    PoolExists,
    ReservationExists,
    UnknownCohort,
    UnknownNode,
    UnknownReservation,
    UnknownTenant,
)


class AdminService:
    """Pools, prices, image policy, tenants, cohorts and reservations."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock

    @retried
    def create_pool(self, cfg: v1.PoolConfig) -> Pool:
        """A new pool with these settings; one that exists is refused (`pool_exists`)."""
        if self.store.find(Pool, Pool.create_id(cfg.pool_id)) is not None:
            raise PoolExists(f"pool {cfg.pool_id!r} exists: change it with pool.set")
        pool = Pool.create(pool_id=PoolId(cfg.pool_id), now=self.clock(),
                           config=pool_config_from_wire(cfg))
        self.store.save(pool)
        return pool

    @retried
    def patch_pool(self, patch: v1.PoolPatch) -> Pool:
        """Change only the settings `patch` names; a new pool takes defaults for the rest."""
        pool = self.store.find(Pool, Pool.create_id(patch.pool_id))
        base = (pool.config if pool is not None
                else pool_config_from_wire(v1.PoolConfig(pool_id=patch.pool_id)))
        return self._put_pool(patch.pool_id, pool, pool_config_patched(base, patch))

    @retried
    def configure_pool(self, cfg: v1.PoolConfig) -> Pool:
        return self._put_pool(cfg.pool_id, self.store.find(Pool, Pool.create_id(cfg.pool_id)),
                              pool_config_from_wire(cfg))

    def _put_pool(self, pool_id: str, pool: Pool | None, config: PoolConfig) -> Pool:
        """`pool` (None: a new one) with `config` in force, saved; unchanged, nothing saved."""
        now = self.clock()
        if pool is None:
            pool = Pool.create(pool_id=PoolId(pool_id), now=now, config=config)
        elif pool.config != config:
            pool.configure(config, now)
        self.store.save(pool)
        return pool

    @retried
    def set_prices(self, pl: v1.PriceListConfig) -> Pool:
        now = self.clock()
        prices = PriceList(
            cpu_core_second=pl.cpu_core_second,
            memory_gib_second=pl.memory_gib_second,
            local_disk_gib_second=pl.local_disk_gib_second,
            gpu_second=tuple({"*": 0, **pl.gpu_second}.items()),
            gpu_partition_second=tuple({"*": 0, **pl.gpu_partition_second}.items()),
        )
        pool = self.store.pool(pl.pool_id)
        pool.set_price_list(prices, now)
        self.store.save(pool)
        return pool

    @retried
    def set_image_policy(self, cfg: v1.ImagePolicyConfig) -> Pool:
        now = self.clock()
        policy = image_policy_from_wire(cfg)
        pool = self.store.pool(cfg.pool_id)
        pool.set_image_policy(policy, now)
        self.store.save(pool)
        return pool

    @retried
    def set_tenant(self, cfg: v1.TenantConfig) -> TenantPolicy:
        """A tenant's settings in a pool; the quota limits only the dimensions it names."""
        now = self.clock()
        self.store.pool(cfg.pool_id)
        if cfg.cohort is not None and self.store.find(
                Cohort, Cohort.create_id(cfg.pool_id, cfg.cohort)) is None:
            raise UnknownCohort(f"pool {cfg.pool_id!r} has no cohort {cfg.cohort!r}; "
                                f"create it with cohort set first")
        weight = max(1, round(cfg.weight * WEIGHT_SCALE))
        settings: dict[str, Any] = {
            "weight": weight, "quota": cfg.quota if cfg.nominal is None else cfg.nominal,
            "borrow_limit": cfg.borrow_limit, "lend_limit": cfg.lend_limit,
            "cohort": cfg.cohort, "preemptible": cfg.preemptible,
            "priority_classes": cfg.priority_classes or (),
        }
        pool = self.store.pool(cfg.pool_id)
        for name in cfg.priority_classes or ():
            pool.rank_of(name)  # a grant names a class the pool has (unknown_priority_class)
        pol = self.store.find(TenantPolicy, TenantPolicy.create_id(cfg.pool_id, cfg.tenant))
        if pol is None:
            pol = TenantPolicy.set(pool_id=PoolId(cfg.pool_id), tenant_id=TenantId(cfg.tenant),
                                   now=now, **settings)
        else:
            pol.update(now=now, **settings)
        listed = pool.list_member("tenant", cfg.tenant, now)
        # its account opens with its first pool, so credits can be granted to it by name
        acc = self.store.find(Account, Account.create_id(cfg.tenant))
        opened = Account.open(tenant_id=TenantId(cfg.tenant), now=now) if acc is None else None
        self.store.save(pol, pool if listed else None, opened)
        return pol

    @retried
    def set_cohort(self, cfg: v1.CohortConfig) -> Cohort:
        """Create or reconfigure a cohort; tenants join it with their own settings."""
        now = self.clock()
        pool = self.store.pool(cfg.pool_id)
        cohort = self.store.find(Cohort, Cohort.create_id(cfg.pool_id, cfg.name))
        if cohort is None:
            cohort = Cohort.create(pool_id=PoolId(cfg.pool_id), name=cfg.name, now=now,
                                   nominal=cfg.nominal, reclaim=cfg.reclaim)
        else:
            cohort.configure(now=now, nominal=cfg.nominal, reclaim=cfg.reclaim)
        listed = pool.list_member("cohort", cfg.name, now)
        self.store.save(cohort, pool if listed else None)
        return cohort

    def reservation(self, pool_id: str, reservation_id: str, *,
                     tenant: str | None = None) -> CapacityReservation:
        """The pool's reservation; one of another tenant is unknown to `tenant`."""
        r = self.store.find(CapacityReservation,
                            CapacityReservation.create_id(pool_id, reservation_id))
        if r is None or (tenant is not None and r.tenant_id != tenant):
            raise UnknownReservation(f"pool {pool_id!r} has no reservation {reservation_id!r}")
        return r

    @retried
    def create_reservation(self, cmd: v1.ReservationCreate) -> CapacityReservation:
        """Withhold capacity over a window; the same create again answers what it made."""
        now = self.clock()
        pool = self.store.pool(cmd.pool_id)
        res = cmd.shape.to_domain() if cmd.shape is not None else Resources()
        for node_id in cmd.node_ids:
            node = self.store.find(Node, Node.create_id(node_id))
            if node is None or node.pool_id != cmd.pool_id:
                raise UnknownNode(f"pool {cmd.pool_id!r} has no node {node_id!r}")
        if cmd.tenant is not None and cmd.tenant not in pool.tenants:
            raise UnknownTenant(f"tenant {cmd.tenant!r} has no settings in pool "
                                f"{cmd.pool_id!r}; set them with tenant set first")
        rid = CapacityReservation.create_id(cmd.pool_id, cmd.reservation_id)
        found = self.store.find(CapacityReservation, rid)
        if found is not None:
            if found.same_request(tenant_id=cmd.tenant, resources=res, count=cmd.count,
                                  node_ids=cmd.node_ids, start_at=float(cmd.start_at),
                                  end_at=float(cmd.start_at) + cmd.duration_seconds):
                return found
            raise ReservationExists(f"reservation {cmd.reservation_id!r} exists in pool "
                                    f"{cmd.pool_id!r} with other settings")
        r = CapacityReservation.create(
            reservation_id=cmd.reservation_id, pool_id=PoolId(cmd.pool_id),
            tenant_id=cmd.tenant, resources=res, count=cmd.count, node_ids=cmd.node_ids,
            start_at=float(cmd.start_at), duration_seconds=cmd.duration_seconds, now=now)
        listed = pool.list_member("reservation", cmd.reservation_id, now)
        self.store.save(r, pool if listed else None)
        return r

    @retried
    def delete_reservation(self, cmd: v1.ReservationDelete) -> CapacityReservation:
        """Withdraw a reservation at once."""
        r = self.reservation(cmd.pool_id, cmd.reservation_id)
        r.delete(self.clock())
        self.store.save(r)
        return r

    @retried
    def reservation_due(self, reservation_id: str) -> str | None:
        """A maintenance window's drain timer fired: each running lease on its nodes that
        would not end before the window gets a preemption notice with the pool's grace and
        goes back in the queue (as a node drain does). Recorded with the window's own event
        in the same save, so a timer fired twice drains once. None when nothing was due."""
        now = self.clock()
        try:
            r = self.store.find(CapacityReservation, UUID(reservation_id))
        except ValueError:
            return None
        if r is None:
            return None
        grace = self.store.pool(r.pool_id).config.preemption.grace_seconds
        due = r.drain_due_at(grace)
        if due is None or due > now or now >= r.end_at:
            return None
        noticed: list[Lease] = []
        for node_id in r.node_ids:
            node = self.store.find(Node, Node.create_id(node_id))
            for lid in node.allocations if node is not None else ():
                lease = self.store.find(Lease, UUID(lid))
                if (lease is None or lease.state is not LeaseState.RUNNING
                        or not r.must_leave(lease_end_estimate(lease))):
                    continue
                try:
                    lease.notice_preemption(now, grace_seconds=grace, requeue=True,
                                            reason=f"maintenance:{r.reservation_id}")
                except DomainError:
                    continue  # not preemptible: it finishes, and the window waits for it
                noticed.append(lease)
        r.begin_drain(now)
        self.store.save(r, *noticed)
        return f"drained:{len(noticed)}"

    def reservation_next_due(self, reservation_id: str) -> float | None:
        """When a maintenance window's drain timer should fire (None: nothing pending)."""
        try:
            r = self.store.find(CapacityReservation, UUID(reservation_id))
        except ValueError:
            return None
        if r is None:
            return None
        due = r.drain_due_at(self.store.pool(r.pool_id).config.preemption.grace_seconds)
        # one already past was just handled (or the window is over): nothing to fire again
        return due if due is not None and due > self.clock() else None

    def reservations(self, cmd: v1.ReservationList) -> list[dict[str, Any]]:
        """The pool's reservations in start order (ended and deleted ones with `all`)."""
        now = self.clock()
        pool = self.store.pool(cmd.pool_id)
        out = []
        for name in getattr(pool, "reservations", ()):
            r = self.store.find(CapacityReservation,
                                CapacityReservation.create_id(pool.pool_id, name))
            if r is not None and (cmd.all or r.status_at(now) in ("upcoming", "active")):
                out.append(r.to_dict(now))
        return sorted(out, key=lambda d: (d["start_at"], d["reservation_id"]))

    def pool_settings(self, pool_id: str) -> dict[str, Any]:
        pool = self.store.pool(pool_id)
        return {
            "pool_id": pool.pool_id,
            "config": pool.config.to_dict(),
            "config_version": pool.config_version,
            "price_list": pool.price_list.to_dict(),
            "price_list_version": pool.price_list_version,
            "image_policy": pool.image_policy.to_dict(),
            "image_policy_version": pool.image_policy_version,
            "quotas": self.quotas_in_force(pool),
        }

    def quotas_in_force(self, pool: Pool) -> dict[str, Any]:
        """Every tenant's and cohort's limits in the pool, as `pool show` prints them."""
        book = QuotaBook()
        for name in getattr(pool, "cohorts", ()):
            cohort = self.store.find(Cohort, Cohort.create_id(pool.pool_id, name))
            if cohort is not None:
                book.set_cohort(cohort.quota)
        preemptible: dict[str, bool] = {}
        weights: dict[str, float] = {}
        classes: dict[str, list[str]] = {}
        for name in getattr(pool, "tenants", ()):
            pol = self.store.find(TenantPolicy, TenantPolicy.create_id(pool.pool_id, name))
            if pol is not None:
                book.set_tenant(pol.limits)
                preemptible[name] = pol.preemptible
                weights[name] = pol.weight / WEIGHT_SCALE
                classes[name] = list(pool.classes_allowed(pol))
        out = book.in_force()
        for name, row in out["tenants"].items():
            row["preemptible"] = preemptible[name]
            row["weight"] = weights[name]
            row["priority_classes"] = classes[name]
        return out
