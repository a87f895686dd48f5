"""The lease service: a tenant's lease commands, from request to release, and the lease's
deadline timer."""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError

from domain.dependency import Dependency
from domain.errors import DomainError, RateLimited
from domain.gang import GangMembership
from domain.jobspec import JobSpec
from domain.lease import WORKLOAD_STATES, Lease, LeaseState
from domain.node import Node
from domain.policy.gang import GangSpec
from domain.policy.preemption import lease_preemptible
from domain.pool import Pool, TenantPolicy
from domain.resources import PoolId, TenantId
from domain.retry import RetryPolicy
from schemas import v1
from schemas.codec import digest
from schemas.session import SessionOpen
from workers.application.accounts import AccountService
from workers.application.admin import AdminService
from workers.application.core import Store, retried
from workers.application.gangs import GangService, member_job
from workers.application.queue_book import QueueBook
from workers.application.request_rate import RequestRate
from workers.application.workflows import WorkflowService, retry_policy
from workers.errors import IdempotencyConflict, ServiceError


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


CANCELLABLE = (LeaseState.REQUESTED, LeaseState.QUEUED, LeaseState.RESERVED, LeaseState.RUNNING,
               LeaseState.PREEMPTING)


class LeaseService:
    """A tenant's lease commands, from request to release; the leases this process queued
    and the tenants' request rates are its own."""

    def __init__(self, store: Store, clock: Callable[[], float], *, gangs: GangService,
                 accounts: AccountService, workflows: WorkflowService,
                 admin: AdminService) -> None:
        self.store = store
        self.clock = clock
        self.gangs = gangs
        self.accounts = accounts
        self.workflows = workflows
        self.admin = admin
        # the leases this process queued, per tenant and pool: max_queued_leases' count
        self.queue_book = QueueBook()
        # each tenant's lease requests per pool: requests_per_second's token buckets
        self.request_rate = RequestRate()

    def request_lease(self, tenant: str, req: v1.LeaseRequest, *,
                      trace_parent: str | None = None) -> Lease:
        """`request_leases` for a request of one lease."""
        return self.request_leases(tenant, req, trace_parent=trace_parent)[0]

    def request_leases(self, tenant: str, req: v1.LeaseRequest, *,
                       trace_parent: str | None = None,
                       charged: list[tuple[str, str]] | None = None) -> list[Lease]:
        """The `req.count` leases of one request (or the members of its gang, `req.group`),
        accepted in one atomic save: the first has the request's idempotency key, the i-th
        `<key>#<i>` (no client key contains `#`). A retry of the same request answers the
        leases it made; nothing is appended. Each request takes a token of the tenant's in the
        pool first (RateLimited past the pool's rate; `charged` collects the bucket's key)."""
        now = self.clock()
        size = req.count if req.group is None else req.group.members
        keys = [req.idempotency_key, *(f"{req.idempotency_key}#{i}" for i in range(1, size))]
        # fields added later are left out at their defaults, so older digests keep matching
        omit = (("count",) if req.count == 1 else ()) + (
            ("reservation_id",) if req.reservation_id is None else ()) + (
            ("group",) if req.group is None else ()) + (
            ("queue_timeout_seconds",) if req.queue_timeout_seconds is None else ()) + (
            ("retries",) if req.retries is None else ()) + (
            ("after",) if not req.after else ()) + (
            ("after_each",) if req.after_each is None else ()) + (
            ("max_running",) if req.max_running is None else ())
        request_digest = digest(req, omit=omit)
        try:
            pool = self.store.pool_settings(req.pool_id)
            # first and cheapest: a flood is refused before it costs a read or a decision
            bucket = self.request_rate.admit(pool, tenant, now)
            if charged is not None:
                charged.append(bucket)
            policy_id = TenantPolicy.create_id(req.pool_id, tenant)
            policy = self.store.cached(policy_id, lambda: self.store.find(TenantPolicy, policy_id))
            # an unknown class, or one the operator did not grant, is refused before any write
            pool.admit_priority_class(tenant, req.priority_class, policy)
            # a tenant that lets its reservations time out waits out its window
            pool.admit_after_voids(tenant, policy, now)
            pool.admit_runtime(req.maximum_runtime_seconds)
            if req.image:  # no node yet: the image, and the isolation the tenant's standing needs
                pool.admit_image(req.image, signature=req.image_signature,
                                 size_bytes=req.image_size_bytes, tenant=tenant,
                                 isolation=req.shape.runtime)
            if req.reservation_id is not None:
                self.admin.reservation(req.pool_id, req.reservation_id, tenant=tenant)
            retries = retry_policy(pool, req)
            after = self.workflows.dependencies(tenant, req)
            pairs = self.workflows.each_dependency(tenant, req, size)
            book = (tenant, req.pool_id)
            if self.queue_book.queued(book) + size > pool.config.max_queued_leases:
                self.queue_book.recount(book, self.store.last_topics)  # near it: what still waits
            # judged and booked in one step: requests in flight together pass one count each
            self.queue_book.admit(book, [Lease.create_id(tenant, k) for k in keys],
                                  lambda queued: pool.admit_queue(tenant, queued, size))
        except RateLimited:
            raise  # answered at once: looking for what a retry made would cost a read
        except (DomainError, ServiceError):
            # a retry is answered with what it made, whatever the pool says now
            made = self._made(tenant, keys, req, request_digest)
            if made is None:
                raise
            return made
        leases = self._new_leases(tenant, req, keys, now=now, pool=pool, policy=policy,
                                  workflow=(retries, after, pairs), trace_parent=trace_parent,
                                  request_digest=request_digest)
        try:
            # no read first: a new lease's save expects its subject empty, so a retry (or a
            # concurrent one) is refused by the log itself and answered below
            self.store.save(*leases)
        except IntegrityError:
            made = self._made(tenant, keys, req, request_digest)
            if made is None:
                raise
            return made
        return leases

    def _new_leases(self, tenant: str, req: v1.LeaseRequest, keys: list[str], *, now: float,
                    pool: Pool, policy: TenantPolicy | None,
                    workflow: tuple[RetryPolicy | None, tuple[Dependency, ...],
                                    tuple[Dependency, ...] | None],
                    trace_parent: str | None,
                    request_digest: str) -> list[Lease]:
        """The request's leases, as the pool's settings shape them, not yet saved: one per
        key, each a gang member's or an array's index where the request makes those."""
        retries, after, pairs = workflow
        size = len(keys)
        shape = req.shape.to_domain()
        shapes = [shape] * size
        gang: list[GangMembership | None] = [None] * size
        if req.group is not None:  # a gang: its members' own shapes, and their membership
            if req.group.member_shapes:
                shapes = [s.to_domain() for s in req.group.member_shapes]
            gang = list(GangMembership.members(tenant, req.idempotency_key, GangSpec.build(
                size, same=req.group.same, spread=req.group.spread,
                strategy=req.group.strategy)))
        # the pool's timeout is the default and the most a request may ask for
        queue_timeout = min(req.queue_timeout_seconds or pool.config.queue_timeout_seconds,
                            pool.config.queue_timeout_seconds)
        # an array throttled by max_running is named by its first lease
        array_id = (str(Lease.create_id(tenant, keys[0])) if req.max_running is not None
                    else None)
        leases = []
        for i, (key, shape_of, member) in enumerate(zip(keys, shapes, gang, strict=True)):
            lease = Lease.request(
                tenant_id=TenantId(tenant),
                pool_id=PoolId(req.pool_id),
                idempotency_key=key,
                shape=shape_of,
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
                gang=member,
                queued=True,  # requested and queued: one event
                queue_timeout_seconds=queue_timeout,
                name=req.name,
                labels=req.labels,
                retries=retries,
                after=after if pairs is None else tuple(dict.fromkeys((*after, pairs[i]))),
                array_id=array_id,
                max_running=req.max_running,
                array=(i, size) if req.group is None and size > 1 else None,
            )
            leases.append(lease)
        return leases

    def _made(self, tenant: str, keys: list[str], req: v1.LeaseRequest,
              request_digest: str) -> list[Lease] | None:
        """The leases an earlier identical request made (IdempotencyConflict if it differed);
        None when it made none. One atomic save made them all or none."""
        first = self.store.find(Lease, Lease.create_id(tenant, keys[0]))
        if first is None:
            return None
        _retried(first, req, request_digest)
        made = [first]
        for key in keys[1:]:
            lease = self.store.find(Lease, Lease.create_id(tenant, key))
            if lease is None:  # the key was used before for a request of fewer leases
                raise IdempotencyConflict(
                    f"idempotency key {req.idempotency_key!r} was used for a different request")
            made.append(_retried(lease, req, request_digest))
        return made

    @retried
    def commit(self, tenant: str, lease_id: str, body: v1.CommitLease) -> Lease:
        now = self.clock()
        lease = self.store.tenant_lease(tenant, lease_id)
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
                workdir_digest=job.workdir.digest if job.workdir is not None else None,
                workdir_size_bytes=job.workdir.size_bytes if job.workdir is not None else None,
                workdir_files=job.workdir.files if job.workdir is not None else 0,
                artifacts=tuple(job.artifacts),
                secret_env=tuple(job.secret_env.items()),
                secret_files=tuple(job.secret_files.items()),
                secret_versions=tuple(job.secret_versions.items()),
                registry_secret=job.registry_secret,
                volumes=tuple(job.volumes.items()), stdin=job.stdin,
            )
        # a gang commits whole: every member starts its job, told its rank and peers' nodes
        members = self.gangs.with_gang(lease, LeaseState.RESERVED)
        nodes = [str(m.node_id) for m in members]
        for member in members:
            job_of = member_job(member, spec, nodes)
            self._admit_job(member, job_of)
            member.commit(now, job_of)
        self.store.save(*members)
        return lease

    def _admit_job(self, lease: Lease, spec: JobSpec | None) -> None:
        """The pool's image policy, checked against the node the lease holds: raises
        ImageNotAllowed before anything is recorded."""
        pool = self.store.pool_settings(lease.pool_id)
        node = (None if lease.node_id is None
                else self.store.find(Node, Node.create_id(lease.node_id)))
        pool.admit_image(
            spec.image if spec is not None else None,
            signature=spec.image_signature if spec is not None else None,
            size_bytes=spec.image_size_bytes if spec is not None else None,
            tenant=lease.tenant_id,
            node_trust=node.capabilities.trust_level if node is not None else None,
            isolation=lease.shape.runtime,
        )
        if spec is not None:
            pool.admit_workdir(spec.workdir_size_bytes)
            pool.admit_volumes(spec.volumes,
                               node.capabilities.trust_level if node is not None else None)

    @retried
    def heartbeat(self, tenant: str, lease_id: str, body: v1.HeartbeatLease) -> Lease:
        now = self.clock()
        lease = self.store.tenant_lease(tenant, lease_id)
        members = self.gangs.with_gang(lease, *WORKLOAD_STATES)  # members share their epoch
        # only the members it is news for are saved: a flood appends nothing (domain decides)
        beaten = [m for m in members
                  if m.heartbeat(now, epoch=body.epoch, checkpoint_at=body.last_checkpoint_at)]
        if beaten:
            self.store.save(*beaten)
        return lease

    @retried
    def renew(self, tenant: str, lease_id: str, body: v1.RenewLease) -> Lease:
        now = self.clock()
        lease = self.store.tenant_lease(tenant, lease_id)
        members = self.gangs.with_gang(lease, LeaseState.RUNNING)
        step = self.store.pool_settings(lease.pool_id).config.renew_step_seconds
        for member in members:
            member.renew(now, body.extend_seconds, step_seconds=step)
        # a renewal that moved no deadline by the pool's step recorded nothing: nothing to save
        moved = [m for m in members if m.pending_events]
        if moved:
            self.store.save(*moved)
        return lease

    @retried
    def open_session(self, tenant: str, lease_id: str, body: SessionOpen) -> Lease:
        """Record an interactive session into the tenant's running lease; the dispatcher tells
        the lease's node from the event (docs/exec.md)."""
        lease = self.store.tenant_lease(tenant, lease_id)
        lease.open_session(self.clock(), session_id=body.session_id, kind=body.kind,
                           command=tuple(body.command), tty=body.tty, port=body.port,
                           rows=body.rows, cols=body.cols)
        self.store.save(lease)
        return lease

    @retried
    def release(self, tenant: str, lease_id: str, body: v1.ReleaseLease) -> Lease:
        now = self.clock()
        lease = self.store.tenant_lease(tenant, lease_id)
        node_id = lease.node_id  # a retried attempt forgets its placement
        lease.release(now, body.exit_code)
        self.store.save(lease, *self.accounts.settle(lease, now, node_id))
        return lease

    @retried
    def cancel(self, tenant: str, lease_id: str, body: v1.CancelLease) -> Lease:
        now = self.clock()
        lease = self.store.tenant_lease(tenant, lease_id)
        changed: list[Aggregate] = []
        cache: dict[UUID, Aggregate] = {}
        # a gang is withdrawn or stopped whole (members on their way out already go)
        for member in self.gangs.with_gang(lease, *CANCELLABLE):
            member.cancel(now, body.reason or "cancelled")
            changed.append(member)
            if not member.holds_capacity:
                changed += self.accounts.settle(member, now, cache=cache)
        self.store.save(*list({a.id: a for a in changed}.values()))
        return lease

    @retried
    def reconcile_due(self, lease_id: str) -> str | None:
        """A lease's deadline timer fired: end a lease that waited its queue timeout
        (`queue_timeout`), void an uncommitted reservation (capacity and hold returned) or
        expire a silent lease into `reconciling` (capacity kept until the agent confirms).
        Returns what was done, or None when nothing was due (a renewed lease)."""
        now = self.clock()
        try:
            lease = self.store.find(Lease, UUID(lease_id))
        except ValueError:
            return None
        if lease is None:
            return None
        if lease.state is LeaseState.HELD:  # a backoff over, or a dependency's lease ended
            return self.workflows.resolve_held(lease, now)
        reason = lease.expiry_due(now)
        if reason is None:
            return None
        if lease.state is LeaseState.QUEUED:
            # waited its queue timeout: it leaves the queue, and a gang's waiting members too
            members = self.gangs.with_gang(lease, LeaseState.QUEUED)
            for member in members:
                member.reject(now, reason, ["queue_timeout_seconds"])
            self.store.save(*members)
            return reason
        if lease.state is LeaseState.RESERVED:
            lease.void_reservation(now)
            # the tenant's policy remembers it, in the same save (Pool.admit_after_voids)
            policy = self.store.find(TenantPolicy, TenantPolicy.create_id(lease.pool_id,
                                                                   lease.tenant_id))
            noted = self.store.pool_settings(lease.pool_id).note_voided_reservation(policy, now)
            self.store.save(lease, *self.accounts.settle(lease, now), policy if noted else None)
            return "voided"
        lease.expire(now, reason)
        lease.begin_reconciliation(now)
        # a gang member's running peers go with it (one notice, one grace), in this save
        peers = self.gangs.peers_noticed(
            [lease], now, self.store.pool(lease.pool_id).config.preemption.grace_seconds
        ) if lease.gang is not None else []
        self.store.save(lease, *peers)
        return f"expired:{reason}"

    def lease_next_due(self, lease_id: str) -> float | None:
        """When the lease's deadline timer should next fire (None: nothing pending)."""
        try:
            lease = self.store.find(Lease, UUID(lease_id))
        except ValueError:
            return None
        due = None if lease is None else lease.next_due_at()
        return due if due is not None and due > self.clock() else None

    def get(self, tenant: str, lease_id: str) -> Lease:
        return self.store.tenant_lease(tenant, lease_id)

    async def request_leases_async(self, tenant: str, req: v1.LeaseRequest, *,
                                   trace_parent: str | None = None) -> list[Lease] | None:
        """`request_leases` on the bus's loop for a new request whose pool and policy are
        cached; None for anything that needs a read (a retry, a refusal, a cold cache): the
        caller then runs `request_leases` on a thread, and the token it took is given back
        (one request, one token)."""
        charged: list[tuple[str, str]] = []
        try:
            made = await self.store.on_loop(lambda: self.request_leases(
                tenant, req, trace_parent=trace_parent, charged=charged))
        except RateLimited:
            raise
        except BaseException:
            self._give_back(charged, req.pool_id)
            raise
        if made is None:
            self._give_back(charged, req.pool_id)
        return made

    def _give_back(self, charged: list[tuple[str, str]], pool_id: str) -> None:
        """Return the tokens of a request handed to a thread. This runs on the bus's loop, so
        it reads nothing: a pool no longer cached keeps the token (one request counted twice),
        where a read here once held the loop, and every answer due on it, for 45 s."""
        if not charged:
            return
        pool = self.store.cached_now(Pool.create_id(pool_id))
        if pool is not None:
            self.request_rate.give_back(charged, pool)
