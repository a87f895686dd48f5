"""The control plane's eventsourcing Application: each command loads, decides and saves.
One atomic save per decision, however many aggregates; `now` is read here, at the edge.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar
from uuid import UUID

from eventsourcing.application import AggregateNotFoundError, Application, ProcessingEvent
from eventsourcing.domain import Aggregate, BaseAggregate
from eventsourcing.persistence import IntegrityError, Notification, Recording, StoredEvent

from bus.errors import BusTimeout
from control.errors import (
    IdempotencyConflict,
    PoolExists,
    ReservationExists,
    ServiceError,
    UnknownCohort,
    UnknownLease,
    UnknownNode,
    UnknownPool,
    UnknownReservation,
    UnknownTenant,
    WriteConflict,
)
from domain.account import Account
from domain.cohort import Cohort
from domain.enrollment import Enrollment
from domain.errors import DomainError, NodeClaimRefused
from domain.lease import WORKLOAD_STATES, JobSpec, Lease, LeaseState
from domain.node import Node, NodeState
from domain.policy.backfill import lease_end_estimate
from domain.policy.preemption import lease_preemptible
from domain.pool import Pool, PriceList, TenantPolicy
from domain.quota import QuotaBook
from domain.reservation import CapacityReservation
from domain.resources import LeaseId, NodeCapabilities, NodeId, PoolId, Resources, TenantId
from domain.transfer import CreditTransfer
from schemas import v1
from schemas.codec import digest
from schemas.convert import (
    image_policy_from_wire,
    lease_view,
    pool_config_from_wire,
    pool_config_patched,
)

A = TypeVar("A", bound=Aggregate)
C = TypeVar("C")
R = TypeVar("R")
P = ParamSpec("P")


def retried(
    command: Callable[Concatenate[PoolApp, P], R],
) -> Callable[Concatenate[PoolApp, P], R]:
    """A load-decide-save command, run again when a concurrent writer got there first (OCC)."""

    @functools.wraps(command)
    def run(app: PoolApp, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return app.retrying(lambda: command(app, *args, **kwargs))

    return run

APPLICATION_NAME = "pool"
WEIGHT_SCALE = 1000
# how long a request may use a cached policy without a word from the log (a lost invalidation)
POLICY_CACHE_SECONDS = 5.0  # tenant weights travel as floats and are kept as integer thousandths


class PoolApp(Application[UUID]):
    """Every write the control plane makes goes through one of these methods."""

    name = APPLICATION_NAME
    is_snapshotting_enabled = False

    def __init__(self, env: dict[str, str] | None = None, clock: Callable[[], float] = time.time):
        super().__init__(env)
        self.clock = clock
        # pools and tenant policies as requests read them (see _cached): id → (it, good until)
        self._policies: dict[UUID, tuple[Any, float]] = {}
        self._policy_changes: dict[UUID, int] = {}
        self._policy_watches: dict[UUID, Callable[[], None]] = {}
        self._policies_lock = threading.Lock()

    # -- plumbing --------------------------------------------------------------------------

    def save(self, *objs: Any, **kwargs: Any) -> list[Recording[UUID]]:
        """The library's `save`, without its runtime-checkable Protocol `isinstance` checks
        (~20 µs an aggregate on Python 3.11): aggregates are known by their class; events and
        keyword arguments go the library's way."""
        if kwargs:
            return super().save(*objs, **kwargs)
        pe = self._collect(objs)
        recordings = self._record(pe)
        self._recorded(pe, recordings)
        return recordings

    def save_nowait(self, *aggs: Aggregate) -> PendingSave:
        """`save` whose atomic batch is under way when this returns: the events are taken
        from the aggregates and encoded here; `PendingSave.result()` waits for the
        acknowledgement (IntegrityError on a conflict, as `save`). A later save that shares
        a subject must wait for this one's result first, else its expectation is stale."""
        pe = self._collect(aggs)
        stored = [self.mapper.to_stored_event(e) for e in pe.events]
        submit = getattr(self.recorder, "insert_events_nowait", None)
        if submit is None:  # another persistence module: save now, answer later
            future: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
            try:
                future.set_result(list(self.recorder.insert_events(stored) or []))
            except Exception as e:  # noqa: BLE001 - handed to whoever asks for the result
                future.set_exception(e)
        else:
            future = submit(stored)
        return PendingSave(self, pe, stored, future)

    def _collect(self, objs: tuple[Any, ...]) -> ProcessingEvent[UUID]:
        pe: ProcessingEvent[UUID] = ProcessingEvent()
        for obj in objs:
            if obj is None:
                continue
            if isinstance(obj, BaseAggregate):
                pe.events.extend(obj.collect_events())
                pe.aggregates[obj.id] = obj
            else:
                pe.collect_events(obj)
        return pe

    def _recorded(self, pe: ProcessingEvent[UUID], recordings: list[Recording[UUID]]) -> None:
        """What the library's `save` does once the events are recorded."""
        self._take_snapshots(pe)
        self._notify(recordings)
        self.notify(pe.events)  # deprecated in the library, still called by its save

    def find(self, cls: type[A], aggregate_id: UUID) -> A | None:
        try:
            agg: object = self.repository.get(aggregate_id)
        except AggregateNotFoundError:
            return None
        if not isinstance(agg, cls):
            return None
        return agg

    def retrying(self, decide: Callable[[], R], attempts: int = 5) -> R:
        """Run load-decide-save again when a concurrent writer got there first (OCC)."""
        for _ in range(attempts):
            try:
                return decide()
            except IntegrityError:
                continue
        raise WriteConflict("the lease kept changing under this command; try again")

    def _pool(self, pool_id: str) -> Pool:
        pool = self.find(Pool, Pool.create_id(pool_id))
        if pool is None:
            raise UnknownPool(f"no pool named {pool_id!r}")
        return pool

    def _lease_if(self, lease_id: str, owned: Callable[[Lease], bool], where: str) -> Lease:
        """The lease `lease_id` when `owned` says it belongs to the asker; else UnknownLease
        (someone else's lease reads as missing: ids are not secrets, ownership is)."""
        try:
            uid = UUID(lease_id)
        except ValueError:
            raise UnknownLease(f"no lease {lease_id!r}") from None
        lease = self.find(Lease, uid)
        if lease is None or not owned(lease):
            raise UnknownLease(f"no lease {lease_id!r} {where}")
        return lease

    def _lease(self, tenant: str, lease_id: str) -> Lease:
        return self._lease_if(lease_id, lambda lease: lease.tenant_id == tenant,
                              f"for tenant {tenant!r}")

    def _account(self, tenant: str, now: float) -> Account:
        acc = self.find(Account, Account.create_id(tenant))
        return acc if acc is not None else Account.open(tenant_id=TenantId(tenant), now=now)

    # -- admin -----------------------------------------------------------------------------

    @retried
    def create_pool(self, cfg: v1.PoolConfig) -> Pool:
        """A new pool with these settings; one that exists is refused (`pool_exists`)."""
        if self.find(Pool, Pool.create_id(cfg.pool_id)) is not None:
            raise PoolExists(f"pool {cfg.pool_id!r} exists: change it with pool.set")
        pool = Pool.create(pool_id=PoolId(cfg.pool_id), now=self.clock(),
                           config=pool_config_from_wire(cfg))
        self.save(pool)
        return pool

    @retried
    def patch_pool(self, patch: v1.PoolPatch) -> Pool:
        """Change only the settings `patch` names; a new pool takes defaults for the rest."""
        now = self.clock()
        pool = self.find(Pool, Pool.create_id(patch.pool_id))
        base = (pool.config if pool is not None
                else pool_config_from_wire(v1.PoolConfig(pool_id=patch.pool_id)))
        config = pool_config_patched(base, patch)
        if pool is None:
            pool = Pool.create(pool_id=PoolId(patch.pool_id), now=now, config=config)
        elif pool.config != config:
            pool.configure(config, now)
        self.save(pool)
        return pool

    @retried
    def configure_pool(self, cfg: v1.PoolConfig) -> Pool:
        now = self.clock()
        config = pool_config_from_wire(cfg)
        pool = self.find(Pool, Pool.create_id(cfg.pool_id))
        if pool is None:
            pool = Pool.create(pool_id=PoolId(cfg.pool_id), now=now, config=config)
        elif pool.config != config:
            pool.configure(config, now)
        self.save(pool)
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
        pool = self._pool(pl.pool_id)
        pool.set_price_list(prices, now)
        self.save(pool)
        return pool

    @retried
    def set_image_policy(self, cfg: v1.ImagePolicyConfig) -> Pool:
        now = self.clock()
        policy = image_policy_from_wire(cfg)
        pool = self._pool(cfg.pool_id)
        pool.set_image_policy(policy, now)
        self.save(pool)
        return pool

    @retried
    def set_tenant(self, cfg: v1.TenantConfig) -> TenantPolicy:
        """A tenant's settings in a pool; the quota limits only the dimensions it names."""
        now = self.clock()
        self._pool(cfg.pool_id)
        if cfg.cohort is not None and self.find(
                Cohort, Cohort.create_id(cfg.pool_id, cfg.cohort)) is None:
            raise UnknownCohort(f"pool {cfg.pool_id!r} has no cohort {cfg.cohort!r}; "
                                f"create it with cohort set first")
        weight = max(1, round(cfg.weight * WEIGHT_SCALE))
        settings: dict[str, Any] = {
            "weight": weight, "quota": cfg.quota if cfg.nominal is None else cfg.nominal,
            "borrow_limit": cfg.borrow_limit, "lend_limit": cfg.lend_limit,
            "cohort": cfg.cohort, "preemptible": cfg.preemptible,
        }
        pool = self._pool(cfg.pool_id)
        pol = self.find(TenantPolicy, TenantPolicy.create_id(cfg.pool_id, cfg.tenant))
        if pol is None:
            pol = TenantPolicy.set(pool_id=PoolId(cfg.pool_id), tenant_id=TenantId(cfg.tenant),
                                   now=now, **settings)
        else:
            pol.update(now=now, **settings)
        listed = pool.list_member("tenant", cfg.tenant, now)
        # its account opens with its first pool, so credits can be granted to it by name
        acc = self.find(Account, Account.create_id(cfg.tenant))
        opened = Account.open(tenant_id=TenantId(cfg.tenant), now=now) if acc is None else None
        self.save(pol, pool if listed else None, opened)
        return pol

    @retried
    def set_cohort(self, cfg: v1.CohortConfig) -> Cohort:
        """Create or reconfigure a cohort; tenants join it with their own settings."""
        now = self.clock()
        pool = self._pool(cfg.pool_id)
        cohort = self.find(Cohort, Cohort.create_id(cfg.pool_id, cfg.name))
        if cohort is None:
            cohort = Cohort.create(pool_id=PoolId(cfg.pool_id), name=cfg.name, now=now,
                                   nominal=cfg.nominal, reclaim=cfg.reclaim)
        else:
            cohort.configure(now=now, nominal=cfg.nominal, reclaim=cfg.reclaim)
        listed = pool.list_member("cohort", cfg.name, now)
        self.save(cohort, pool if listed else None)
        return cohort

    def _reservation(self, pool_id: str, reservation_id: str, *,
                     tenant: str | None = None) -> CapacityReservation:
        """The pool's reservation; one of another tenant is unknown to `tenant`."""
        r = self.find(CapacityReservation, CapacityReservation.create_id(pool_id, reservation_id))
        if r is None or (tenant is not None and r.tenant_id != tenant):
            raise UnknownReservation(f"pool {pool_id!r} has no reservation {reservation_id!r}")
        return r

    @retried
    def create_reservation(self, cmd: v1.ReservationCreate) -> CapacityReservation:
        """Withhold capacity over a window; the same create again answers what it made."""
        now = self.clock()
        pool = self._pool(cmd.pool_id)
        res = cmd.shape.to_domain() if cmd.shape is not None else Resources()
        for node_id in cmd.node_ids:
            node = self.find(Node, Node.create_id(node_id))
            if node is None or node.pool_id != cmd.pool_id:
                raise UnknownNode(f"pool {cmd.pool_id!r} has no node {node_id!r}")
        if cmd.tenant is not None and cmd.tenant not in pool.tenants:
            raise UnknownTenant(f"tenant {cmd.tenant!r} has no settings in pool "
                                f"{cmd.pool_id!r}; set them with tenant set first")
        rid = CapacityReservation.create_id(cmd.pool_id, cmd.reservation_id)
        found = self.find(CapacityReservation, rid)
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
        self.save(r, pool if listed else None)
        return r

    @retried
    def delete_reservation(self, cmd: v1.ReservationDelete) -> CapacityReservation:
        """Withdraw a reservation at once."""
        r = self._reservation(cmd.pool_id, cmd.reservation_id)
        r.delete(self.clock())
        self.save(r)
        return r

    @retried
    def reservation_due(self, reservation_id: str) -> str | None:
        """A maintenance window's drain timer fired: each running lease on its nodes that
        would not end before the window gets a preemption notice with the pool's grace and
        goes back in the queue (as a node drain does). Recorded with the window's own event
        in the same save, so a timer fired twice drains once. None when nothing was due."""
        now = self.clock()
        try:
            r = self.find(CapacityReservation, UUID(reservation_id))
        except ValueError:
            return None
        if r is None:
            return None
        grace = self._pool(r.pool_id).config.preemption.grace_seconds
        due = r.drain_due_at(grace)
        if due is None or due > now or now >= r.end_at:
            return None
        noticed: list[Lease] = []
        for node_id in r.node_ids:
            node = self.find(Node, Node.create_id(node_id))
            for lid in node.allocations if node is not None else ():
                lease = self.find(Lease, UUID(lid))
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
        self.save(r, *noticed)
        return f"drained:{len(noticed)}"

    def reservation_next_due(self, reservation_id: str) -> float | None:
        """When a maintenance window's drain timer should fire (None: nothing pending)."""
        try:
            r = self.find(CapacityReservation, UUID(reservation_id))
        except ValueError:
            return None
        if r is None:
            return None
        due = r.drain_due_at(self._pool(r.pool_id).config.preemption.grace_seconds)
        # one already past was just handled (or the window is over): nothing to fire again
        return due if due is not None and due > self.clock() else None

    def reservations(self, cmd: v1.ReservationList) -> list[dict[str, Any]]:
        """The pool's reservations in start order (ended and deleted ones with `all`)."""
        now = self.clock()
        pool = self._pool(cmd.pool_id)
        out = []
        for name in getattr(pool, "reservations", ()):
            r = self.find(CapacityReservation, CapacityReservation.create_id(pool.pool_id, name))
            if r is not None and (cmd.all or r.status_at(now) in ("upcoming", "active")):
                out.append(r.to_dict(now))
        return sorted(out, key=lambda d: (d["start_at"], d["reservation_id"]))

    @retried
    def register_node(self, reg: v1.NodeRegistration, *,
                      capabilities: NodeCapabilities | None = None) -> Node:
        now = self.clock()
        self._pool(reg.pool_id)
        caps = capabilities or reg.capabilities.to_domain()
        node = self.find(Node, Node.create_id(reg.node_id))
        if node is None:
            node = Node.register(
                node_id=NodeId(reg.node_id), pool_id=PoolId(reg.pool_id),
                capabilities=caps, now=now,
            )
        elif node.capabilities != caps or node.state is NodeState.LOST:
            node.reregister(caps, now)  # a lost node comes back ready
        self.save(node)
        return node

    @retried
    def node_offline(self, node_id: str, reason: str = "agent_stopped") -> Node:
        """The node's agent stopped cleanly: with nothing allocated on it, the node is lost at
        once (no placements) instead of after the node timeout; its next registration brings
        it back. A node still holding leases is left as it is: their workloads may still run,
        and the agent re-adopts them when it starts again."""
        node = self.find(Node, Node.create_id(node_id))
        if node is None:
            raise UnknownNode(f"no node {node_id!r}")
        if not node.allocations and node.state is not NodeState.LOST:
            node.mark_lost(self.clock(), reason)
            self.save(node)
        return node

    @retried
    def node_state(self, node_id: str, verb: str, reason: str = "") -> Node:
        now = self.clock()
        node = self.find(Node, Node.create_id(node_id))
        if node is None:
            raise UnknownNode(f"no node {node_id!r}")
        actions: dict[str, Callable[[], None]] = {
            "cordon": lambda: node.cordon(now, reason),
            "drain": lambda: node.drain(now, reason),
            "maintenance": lambda: node.enter_maintenance(now, reason),
            "uncordon": lambda: node.uncordon(now),
            "end-maintenance": lambda: node.end_maintenance(now),
            "lost": lambda: node.mark_lost(now, reason or "declared_lost"),
        }
        actions[verb]()
        leases = self._drain_leases(node, now, reason) if verb == "drain" else []
        self.save(node, *leases)
        return node

    def _drain_leases(self, node: Node, now: float, reason: str) -> list[Lease]:
        """A drain winds the node down: each running lease gets a preemption notice with the
        pool's grace (its deadline) and goes back in the queue to run elsewhere; the agent
        stops it and the capacity is freed on its confirmation. A lease that may not be
        preempted is left to finish."""
        grace = self._pool(node.pool_id).config.preemption.grace_seconds
        out: list[Lease] = []
        for lid in node.allocations:
            lease = self.find(Lease, UUID(lid))
            if lease is None or lease.state is not LeaseState.RUNNING:
                continue
            try:
                lease.notice_preemption(now, grace_seconds=grace, requeue=True,
                                        reason=f"drain:{reason}" if reason else "drain")
            except DomainError:
                continue
            out.append(lease)
        return out

    @retried
    def grant(self, tenant: str, amount: int, transfer_id: str, reason: str = "", *,
              known_only: bool = False) -> Account:
        """Add credits; with `known_only` (the admin subject), only to a tenant set in a pool
        (whose account tenant.set opened), so a misspelt name is refused, not credited."""
        now = self.clock()
        if known_only and self.find(Account, Account.create_id(tenant)) is None:
            raise UnknownTenant(f"no tenant {tenant!r} in any pool: set it first "
                                f"(pool admin tenant set {tenant} --pool POOL)")
        # the transfer id is claimed across accounts: another tenant or amount is a conflict
        claim = self.find(CreditTransfer, CreditTransfer.create_id(transfer_id))
        if claim is not None:
            claim.check(tenant, amount)
        acc = self._account(tenant, now)
        if acc.grant(transfer_id, amount, now, reason) and claim is None:
            self.save(acc, CreditTransfer.claim(transfer_id=transfer_id, tenant_id=tenant,
                                                amount=amount, now=now))
        else:
            self.save(acc)
        return acc

    # -- tenant commands -------------------------------------------------------------------

    def request_lease(self, tenant: str, req: v1.LeaseRequest, *,
                      trace_parent: str | None = None) -> Lease:
        """`request_leases` for a request of one lease."""
        return self.request_leases(tenant, req, trace_parent=trace_parent)[0]

    def request_leases(self, tenant: str, req: v1.LeaseRequest, *,
                       trace_parent: str | None = None) -> list[Lease]:
        """The `req.count` leases of one request, accepted in one atomic save: the first has
        the request's idempotency key, the i-th `<key>#<i>` (no client key contains `#`). A
        retry of the same request answers the leases it made; nothing is appended."""
        now = self.clock()
        keys = [req.idempotency_key, *(f"{req.idempotency_key}#{i}" for i in range(1, req.count))]
        # fields added later are left out at their defaults, so older digests keep matching
        omit = (("count",) if req.count == 1 else ()) + (
            ("reservation_id",) if req.reservation_id is None else ())
        request_digest = digest(req, omit=omit)
        try:
            pool = self._cached(Pool.create_id(req.pool_id), lambda: self._pool(req.pool_id))
            pool.rank_of(req.priority_class)  # an unknown class is refused before any write
            pool.admit_runtime(req.maximum_runtime_seconds)
            policy_id = TenantPolicy.create_id(req.pool_id, tenant)
            policy = self._cached(policy_id, lambda: self.find(TenantPolicy, policy_id))
            if req.image:  # no node yet: the image, and the isolation the tenant's standing needs
                pool.admit_image(req.image, signature=req.image_signature,
                                 size_bytes=req.image_size_bytes, tenant=tenant,
                                 isolation=req.shape.runtime)
            if req.reservation_id is not None:
                self._reservation(req.pool_id, req.reservation_id, tenant=tenant)
        except (DomainError, ServiceError):
            # a retry is answered with what it made, whatever the pool says now
            made = self._made(tenant, keys, req, request_digest)
            if made is None:
                raise
            return made
        shape = req.shape.to_domain()
        leases = []
        for key in keys:
            lease = Lease.request(
                tenant_id=TenantId(tenant),
                pool_id=PoolId(req.pool_id),
                idempotency_key=key,
                shape=shape,
                maximum_runtime_seconds=req.maximum_runtime_seconds,
                now=now,
                lease_seconds=min(pool.config.default_lease_seconds,
                                  req.maximum_runtime_seconds),
                heartbeat_timeout_seconds=pool.config.heartbeat_timeout_seconds,
                priority_class=req.priority_class,
                preemptible=lease_preemptible(pool, policy, req.priority_class),
                trace_parent=trace_parent,
                request_digest=request_digest,
                checkpointable=req.checkpointable,
                requeue_when_preempted=req.preemptible_requeue,
                advance_reservation_id=req.reservation_id,
            )
            lease.queue(now)
            leases.append(lease)
        try:
            # no read first: a new lease's save expects its subject empty, so a retry (or a
            # concurrent one) is refused by the log itself and answered below
            self.save(*leases)
        except IntegrityError:
            made = self._made(tenant, keys, req, request_digest)
            if made is None:
                raise
            return made
        return leases

    def _made(self, tenant: str, keys: list[str], req: v1.LeaseRequest,
              request_digest: str) -> list[Lease] | None:
        """The leases an earlier identical request made (IdempotencyConflict if it differed);
        None when it made none. One atomic save made them all or none."""
        first = self.find(Lease, Lease.create_id(tenant, keys[0]))
        if first is None:
            return None
        _retried(first, req, request_digest)
        made = [first]
        for key in keys[1:]:
            lease = self.find(Lease, Lease.create_id(tenant, key))
            if lease is None:  # the key was used before for a request of fewer leases
                raise IdempotencyConflict(
                    f"idempotency key {req.idempotency_key!r} was used for a different request")
            made.append(_retried(lease, req, request_digest))
        return made

    def _cached(self, aggregate_id: UUID, load: Callable[[], C]) -> C:
        """A policy aggregate (a pool, a tenant's policy) as requests read it: cached, and
        dropped from the cache when the log stores an event of it, so a request never pays a
        read of a policy it has seen. Without a persistence module that can watch, every
        request reads it. A request only reads what it gets (the object is shared)."""
        hit = self._policies.get(aggregate_id)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]  # type: ignore[no-any-return]
        watch = getattr(self.recorder, "watch_appends", None)
        if watch is None:
            return load()
        with self._policies_lock:
            if aggregate_id not in self._policy_watches:
                def forget(key: UUID = aggregate_id) -> None:
                    self._policy_changes[key] = self._policy_changes.get(key, 0) + 1
                    self._policies.pop(key, None)

                self._policy_watches[aggregate_id] = watch(aggregate_id, forget)
        changes = self._policy_changes.get(aggregate_id, 0)
        value = load()
        if self._policy_changes.get(aggregate_id, 0) == changes:  # nothing stored meanwhile
            self._policies[aggregate_id] = (value, time.monotonic() + POLICY_CACHE_SECONDS)
        return value

    def close(self) -> None:
        for unwatch in self._policy_watches.values():
            unwatch()
        self._policy_watches.clear()
        super().close()

    @retried
    def commit(self, tenant: str, lease_id: str, body: v1.CommitLease) -> Lease:
        now = self.clock()
        lease = self._lease(tenant, lease_id)
        job = body.job
        spec = None
        if job.image or job.command:  # a commit may claim capacity before naming its job
            spec = JobSpec(
                image=job.image or "",
                command=tuple(job.command),
                env=tuple(sorted(job.env.items())),
                checkpoint_interval_seconds=job.checkpoint_policy.interval_seconds,
                image_signature=job.image_signature,
                image_size_bytes=job.image_size_bytes,
            )
        self._admit_job(lease, spec)
        lease.commit(now, spec)
        self.save(lease)
        return lease

    def _admit_job(self, lease: Lease, spec: JobSpec | None) -> None:
        """The pool's image policy, checked against the node the lease holds: raises
        ImageNotAllowed before anything is recorded."""
        pool = self._pool(lease.pool_id)
        node = None if lease.node_id is None else self.find(Node, Node.create_id(lease.node_id))
        pool.admit_image(
            spec.image if spec is not None else None,
            signature=spec.image_signature if spec is not None else None,
            size_bytes=spec.image_size_bytes if spec is not None else None,
            tenant=lease.tenant_id,
            node_trust=node.capabilities.trust_level if node is not None else None,
            isolation=lease.shape.runtime,
        )

    @retried
    def heartbeat(self, tenant: str, lease_id: str, body: v1.HeartbeatLease) -> Lease:
        now = self.clock()
        lease = self._lease(tenant, lease_id)
        lease.heartbeat(now, epoch=body.epoch, checkpoint_at=body.last_checkpoint_at)
        self.save(lease)
        return lease

    @retried
    def renew(self, tenant: str, lease_id: str, body: v1.RenewLease) -> Lease:
        now = self.clock()
        lease = self._lease(tenant, lease_id)
        lease.renew(now, body.extend_seconds)
        self.save(lease)
        return lease

    def _settle(self, lease: Lease, now: float, node_id: str | None = None,
                cache: dict[UUID, Aggregate] | None = None) -> list[Aggregate]:
        """Free the node and settle the hold for a lease that no longer needs its capacity.

        `node_id` names the node it held when the lease no longer does (a preempted lease
        that was requeued has already forgotten its placement). With `cache`, aggregates
        loaded once are reused, so settling several leases touches one node / account object."""
        out: list[Aggregate] = []
        cache = {} if cache is None else cache

        def find(cls: type[A], uid: UUID) -> A | None:
            if uid not in cache:
                found = self.find(cls, uid)
                if found is None:
                    return None
                cache[uid] = found
            got = cache[uid]
            return got if isinstance(got, cls) else None

        where = lease.node_id if node_id is None else node_id
        if where is not None:
            node = find(Node, Node.create_id(where))
            if node is not None and node.free(LeaseId(str(lease.id)), now):
                out.append(node)
        acc = find(Account, Account.create_id(lease.tenant_id))
        lid = LeaseId(str(lease.id))
        if acc is not None and acc.has_hold(lid):
            pool = self._pool(lease.pool_id)
            node_model = None
            if where is not None:
                node = next((a for a in out if isinstance(a, Node)), None) or self.find(
                    Node, Node.create_id(where)
                )
                node_model = node.capabilities.gpu_model if node is not None else None
            seconds = lease.runtime_seconds(now)
            charge = pool.charge_for(lease.shape, seconds, gpu_model=node_model) if seconds else 0
            acc.settle(f"settle-{lease.id}-{lease.epoch}", lid, charge, now)
            out.append(acc)
        return out

    @retried
    def release(self, tenant: str, lease_id: str, body: v1.ReleaseLease) -> Lease:
        now = self.clock()
        lease = self._lease(tenant, lease_id)
        lease.release(now, body.exit_code)
        self.save(lease, *self._settle(lease, now))
        return lease

    @retried
    def cancel(self, tenant: str, lease_id: str, body: v1.CancelLease) -> Lease:
        now = self.clock()
        lease = self._lease(tenant, lease_id)
        lease.cancel(now, body.reason or "cancelled")
        others = self._settle(lease, now) if not lease.holds_capacity else []
        self.save(lease, *others)
        return lease

    # -- node agent reports -----------------------------------------------------------------

    def _node_lease(self, node_id: str, lease_id: str) -> Lease:
        # an agent speaks only for leases placed on its own node
        return self._lease_if(lease_id, lambda lease: lease.node_id == node_id,
                              f"on node {node_id!r}")

    @retried
    def confirm_stopped(self, node_id: str, lease_id: str, body: v1.LeaseStopped) -> Lease:
        """The agent on `node_id` confirms the lease's workload is gone.

        preempting → preempted (or queued again), stopping → cancelled, expired|reconciling →
        released. Only now is the capacity returned: the node is freed and the hold settled in
        the same save, so the log never shows a freed node for a workload still running."""
        now = self.clock()
        lease = self._node_lease(node_id, lease_id)
        lease.confirm_stopped(now, epoch=body.epoch)
        others = [] if lease.holds_capacity else self._settle(lease, now, node_id)
        self.save(lease, *others)
        return lease

    def register_own_node(self, node_id: str, reg: v1.NodeRegistration) -> Node:
        """An agent (re)registers; it may speak only for the node its subject names, within
        its enrollment, and with the enrollment's trust level, never its own."""
        if reg.node_id != node_id:
            raise UnknownNode(f"agent of node {node_id!r} cannot register {reg.node_id!r}")
        enrollment = self.find(Enrollment, Enrollment.create_id(node_id))
        if enrollment is None:
            raise NodeClaimRefused(f"node {node_id!r} is not enrolled: the operator enrolls it "
                                   "(`pool admin node creds NODE --pool POOL …`)",
                                   reasons=("not_enrolled",))
        caps = enrollment.admit(reg.pool_id, reg.capabilities.to_domain())
        return self.register_node(reg, capabilities=caps)

    @retried
    def enroll_node(self, cmd: v1.NodeEnrollment) -> Enrollment:
        """The operator's terms for a node, recorded before its agent may register."""
        now = self.clock()
        self._pool(cmd.pool_id)
        terms: dict[str, Any] = {
            "pool_id": PoolId(cmd.pool_id), "trust_level": cmd.trust_level,
            "max_gpus": cmd.max_gpus, "max_cpu_millis": cmd.max_cpu_millis,
            "max_memory_mib": cmd.max_memory_mib, "gpu_model": cmd.gpu_model, "now": now}
        got = self.find(Enrollment, Enrollment.create_id(cmd.node_id))
        if got is None:
            got = Enrollment.enroll(node_id=NodeId(cmd.node_id), **terms)
        elif not got.change(**terms):
            return got
        self.save(got)
        return got

    def node_heartbeat(self, node_id: str, hb: v1.NodeHeartbeat) -> dict[str, Any]:
        """The node and every lease it runs are alive. The leases' heartbeats are ONE atomic
        save; the node's own heartbeat is a second one, so the scheduler allocating on a busy
        node (a write to the node) never makes the leases' heartbeats fail. Returns, per lease,
        whether it is still live here, so the agent stops what must not run."""
        node = self.find(Node, Node.create_id(node_id))
        if node is None or hb.node_id != node_id:
            raise UnknownNode(f"no node {node_id!r}; register first")
        if node.state is NodeState.LOST:
            return {"node_state": str(node.state), "register": True, "leases": {}}

        def beat_leases() -> dict[str, dict[str, Any]]:
            now = self.clock()
            changed: list[Aggregate] = []
            out = {b.lease_id: self._beat(node_id, b, now, changed) for b in hb.leases}
            if changed:
                self.save(*changed)
            return out

        def beat_node() -> Node:
            fresh = self.find(Node, Node.create_id(node_id))
            assert fresh is not None
            pool = self._cached(Pool.create_id(fresh.pool_id), lambda: self._pool(fresh.pool_id))
            timeout = pool.config.node_timeout_seconds
            if fresh.state is not NodeState.LOST and fresh.heartbeat_is_news(self.clock(),
                                                                            timeout):
                fresh.heartbeat(self.clock())
                self.save(fresh)
            return fresh

        leases = self.retrying(beat_leases) if hb.leases else {}
        node = self.retrying(beat_node)
        if node.state is NodeState.LOST:
            return {"node_state": str(node.state), "register": True, "leases": leases}
        if any(lid not in leases for lid in node.allocations):
            # only then can a lease under reconciliation be one the agent no longer runs
            leases.update(self.retrying(
                lambda: self._reconcile_unlisted(node_id, set(leases))))
        return {"node_state": str(node.state), "leases": leases}

    def _reconcile_unlisted(self, node_id: str, listed: set[str]) -> dict[str, dict[str, Any]]:
        """A lease being reconciled that the agent no longer runs is confirmed stopped: the
        heartbeat lists every workload the agent has, adopted and stopping ones included."""
        now = self.clock()
        node = self.find(Node, Node.create_id(node_id))
        if node is None:
            return {}
        cache: dict[UUID, Aggregate] = {node.id: node}
        changed: list[Aggregate] = []
        out: dict[str, dict[str, Any]] = {}
        unlisted = [UUID(lid) for lid in node.allocations if lid not in listed]
        last_topics = getattr(self.recorder, "last_topics", None)
        if last_topics is not None and unlisted:
            # a lease whose last event is its reservation awaits its commit, no agent runs
            # it: passed over without loading it (a node may hold many such)
            last = last_topics(unlisted)
            unlisted = [u for u in unlisted if not (last[u] or "").endswith(".LeaseReserved")]
        for uid in unlisted:
            lid = str(uid)
            lease = self.find(Lease, uid)
            if lease is not None and lease.state in (LeaseState.EXPIRED, LeaseState.RECONCILING):
                lease.confirm_stopped(now)
                changed += [lease, *self._settle(lease, now, node_id, cache)]
                out[lid] = {"live": False, "state": str(lease.state), "code": "reconciled"}
        if changed:
            self.save(*list({a.id: a for a in changed}.values()))
        return out

    def _beat(self, node_id: str, beat: v1.LeaseBeat, now: float,
              changed: list[Aggregate]) -> dict[str, Any]:
        try:
            lease = self._node_lease(node_id, beat.lease_id)
        except UnknownLease:
            return {"live": False, "code": "lease_not_found"}
        if lease.epoch != beat.epoch or lease.state not in WORKLOAD_STATES:
            # an older placement, or a lease that ended or expired: fenced, the work must stop
            return {"live": False, "state": str(lease.state), "epoch": lease.epoch,
                    "code": "stale_epoch" if lease.epoch != beat.epoch else "lease_not_live"}
        if not lease.heartbeat_is_news(now, beat.last_checkpoint_at):
            return {"live": True, "state": str(lease.state), "deadline": lease.deadline}
        try:
            lease.heartbeat(now, epoch=beat.epoch, checkpoint_at=beat.last_checkpoint_at)
        except DomainError as e:
            return {"live": False, "state": str(lease.state), "code": e.code}
        changed.append(lease)
        return {"live": True, "state": str(lease.state), "deadline": lease.deadline}

    @retried
    def job_started(self, node_id: str, lease_id: str, body: v1.JobStarted) -> Lease:
        lease = self._node_lease(node_id, lease_id)
        lease.job_started(self.clock(), epoch=body.epoch)
        self.save(lease)
        return lease

    @retried
    def job_ended(self, node_id: str, lease_id: str, *, epoch: int,
                  exit_code: int | None = None, failure: str | None = None) -> Lease:
        """The job's process is gone. A running lease is released with its exit code; a lease
        on its way out (stopping, preempting, expired, reconciling) is confirmed stopped. Node
        freed and hold settled in the same save."""
        now = self.clock()
        lease = self._node_lease(node_id, lease_id)
        if (lease.job is not None and lease.job.is_active
                and lease.state in WORKLOAD_STATES):
            if failure is not None:
                lease.job_failed(now, epoch=epoch, reason=failure)
            else:
                assert exit_code is not None
                lease.job_exited(now, epoch=epoch, exit_code=exit_code)
        if lease.state is LeaseState.RUNNING:
            lease.release(now, exit_code, epoch=epoch)
        else:
            lease.confirm_stopped(now, epoch=epoch)
        others = [] if lease.holds_capacity else self._settle(lease, now, node_id)
        self.save(lease, *others)
        return lease

    @retried
    def reconcile_due(self, lease_id: str) -> str | None:
        """A lease's deadline timer fired: void an uncommitted reservation (capacity and hold
        returned) or expire a silent lease into `reconciling` (capacity kept until the agent
        confirms). Returns what was done, or None when nothing was due (a renewed lease)."""
        now = self.clock()
        try:
            lease = self.find(Lease, UUID(lease_id))
        except ValueError:
            return None
        if lease is None:
            return None
        reason = lease.expiry_due(now)
        if reason is None:
            return None
        if lease.state is LeaseState.RESERVED:
            lease.void_reservation(now)
            self.save(lease, *self._settle(lease, now))
            return "voided"
        lease.expire(now, reason)
        lease.begin_reconciliation(now)
        self.save(lease)
        return f"expired:{reason}"

    def lease_next_due(self, lease_id: str) -> float | None:
        """When the lease's deadline timer should next fire (None: nothing pending)."""
        try:
            lease = self.find(Lease, UUID(lease_id))
        except ValueError:
            return None
        due = None if lease is None else lease.next_due_at()
        return due if due is not None and due > self.clock() else None

    def node_next_due(self, node_id: str) -> float | None:
        """When the node's liveness timer should next fire: its heartbeat going stale, or,
        once lost, the release of its leases."""
        node = self.find(Node, Node.create_id(node_id))
        if node is None:
            return None
        cfg = self._pool(node.pool_id).config
        if node.state is NodeState.LOST:
            due = None if not node.allocations or node.lost_at is None else (
                node.lost_at + cfg.lost_node_release_seconds)
        else:
            due = node.last_heartbeat_at + cfg.node_timeout_seconds
        # a deadline already past was just handled: nothing to fire again until a new event
        return due if due is not None and due > self.clock() else None

    @retried
    def node_due(self, node_id: str) -> list[str]:
        """A node's liveness timer fired: a node silent past the pool's node timeout is lost and
        its leases expire into reconciliation; once lost past `lost_node_release_seconds`, its
        reconciling leases are released without the agent's word. Returns what changed."""
        now = self.clock()
        node = self.find(Node, Node.create_id(node_id))
        if node is None:
            return []
        cfg = self._pool(node.pool_id).config
        done: list[str] = []
        changed: list[Aggregate] = []
        if node.state is not NodeState.LOST:
            if not node.heartbeat_stale(now, cfg.node_timeout_seconds):
                return []
            node.mark_lost(now, "heartbeat_lost")
            changed.append(node)
            done.append("node_lost")
            for lid in list(node.allocations):
                lease = self.find(Lease, UUID(lid))
                if lease is not None and lease.state in WORKLOAD_STATES:
                    lease.expire(now, "node_lost")
                    lease.begin_reconciliation(now)
                    changed.append(lease)
                    done.append(f"reconciling:{lid}")
                elif lease is not None and lease.state is LeaseState.EXPIRED:
                    lease.begin_reconciliation(now)
                    changed.append(lease)
        elif now - (node.lost_at or now) >= cfg.lost_node_release_seconds:
            cache: dict[UUID, Aggregate] = {node.id: node}
            for lid in list(node.allocations):
                lease = self.find(Lease, UUID(lid))
                if lease is None or lease.state not in (LeaseState.RECONCILING,
                                                        LeaseState.EXPIRED):
                    continue
                lease.confirm_stopped(now)
                changed += [lease, *self._settle(lease, now, node_id, cache)]
                done.append(f"released:{lid}")
        if changed:
            self.save(*list({a.id: a for a in changed}.values()))
        return done

    def get(self, tenant: str, lease_id: str) -> Lease:
        return self._lease(tenant, lease_id)

    def pool_settings(self, pool_id: str) -> dict[str, Any]:
        pool = self._pool(pool_id)
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
            cohort = self.find(Cohort, Cohort.create_id(pool.pool_id, name))
            if cohort is not None:
                book.set_cohort(cohort.quota)
        preemptible: dict[str, bool] = {}
        weights: dict[str, float] = {}
        for name in getattr(pool, "tenants", ()):
            pol = self.find(TenantPolicy, TenantPolicy.create_id(pool.pool_id, name))
            if pol is not None:
                book.set_tenant(pol.limits)
                preemptible[name] = pol.preemptible
                weights[name] = pol.weight / WEIGHT_SCALE
        out = book.in_force()
        for name, row in out["tenants"].items():
            row["preemptible"] = preemptible[name]
            row["weight"] = weights[name]
        return out


def _retried(lease: Lease, req: v1.LeaseRequest, request_digest: str) -> Lease:
    """`lease` when `req` repeats the request that made it; else IdempotencyConflict. Leases
    recorded before digests are compared on what they kept."""
    if lease.request_digest is not None:
        same = lease.request_digest == request_digest
    else:
        same = (lease.pool_id == req.pool_id and lease.requested_shape == req.shape.to_domain()
                and lease.maximum_runtime_seconds == req.maximum_runtime_seconds
                and lease.priority_class == req.priority_class)
    if not same:
        raise IdempotencyConflict(
            f"idempotency key {req.idempotency_key!r} was used for a different request")
    return lease


def new_transfer_id() -> str:
    return uuid.uuid4().hex


__all__ = ["LeaseState", "PoolApp", "lease_view"]


class PendingSave:
    """A save in flight (`PoolApp.save_nowait`)."""

    def __init__(self, app: PoolApp, pe: ProcessingEvent[UUID], stored: list[StoredEvent],
                 future: concurrent.futures.Future[list[int]]) -> None:
        self.app = app
        self.aggregates = list(pe.aggregates.values())
        self.messages = len(stored)
        self._pe = pe
        self._stored = stored
        self._future = future
        self._ids: list[int] | None = None
        self._recordings: list[Recording[UUID]] | None = None

    def add_done_callback(self, fn: Callable[[bool], None]) -> None:
        """`fn(acknowledged)` once the server has answered or the save failed (on the bus's
        loop thread: keep it short)."""
        self._future.add_done_callback(
            lambda f: fn(not f.cancelled() and f.exception() is None))

    def wait(self) -> None:
        """Wait for the acknowledgement (or raise the save's error) and finish the save as
        `save` would; the recordings are only built if the app listens for them."""
        if self._ids is not None:
            return
        timeout = float(getattr(self.app.recorder, "timeout", 10.0)) + 5
        try:
            ids = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            self._future.cancel()
            raise BusTimeout(f"save not acknowledged within {timeout}s") from None
        self._ids = ids
        pe, app = self._pe, self.app
        cache = app.repository.cache
        if cache and not app.repository.fastforward:
            for aggregate_id, aggregate in pe.aggregates.items():
                cache.put(aggregate_id, aggregate)
        # Application._notify does nothing: a Notification per event is only worth building
        # (frozen dataclasses, a few µs each) for an app that overrides it
        listening = type(app)._notify is not Application._notify
        app._recorded(pe, self.result() if listening else [])  # the app's after-save steps

    @property
    def ids(self) -> list[int]:
        """The notification ids of the saved events, in order (after `wait`)."""
        self.wait()
        assert self._ids is not None
        return self._ids

    def result(self) -> list[Recording[UUID]]:
        """Wait for the acknowledgement; the recordings, or the save's error."""
        self.wait()
        if self._recordings is None:
            assert self._ids is not None
            self._recordings = [
                Recording(d, Notification(originator_id=s.originator_id,
                                          originator_version=s.originator_version,
                                          topic=s.topic, state=s.state, id=n))
                for d, s, n in zip(self._pe.events, self._stored, self._ids, strict=True)
            ]
        return self._recordings
