"""The application's lease and credit commands, from request to release and reconciliation."""

from __future__ import annotations

from uuid import UUID

from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError

from domain.account import Account
from domain.dependency import Dependency
from domain.errors import DomainError, RateLimited
from domain.gang import GangMembership
from domain.jobspec import JobSpec
from domain.lease import WORKLOAD_STATES, Lease, LeaseState
from domain.node import Node
from domain.policy.gang import GangSpec
from domain.policy.preemption import lease_preemptible
from domain.pool import Pool, TenantPolicy
from domain.resources import LeaseId, PoolId, TenantId
from domain.retry import RetryPolicy
from domain.transfer import CreditTransfer
from schemas import v1
from schemas.codec import digest
from schemas.session import SessionOpen
from workers.application.core import A, retried
from workers.application.gangs import GangCommands, member_job
from workers.application.workflows import (
    dependencies,
    each_dependency,
    resolve_held,
    retry_policy,
)
from workers.errors import IdempotencyConflict, ServiceError, UnknownTenant


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


class LeaseCommands(GangCommands):
    """Credits and a tenant's lease commands, from request to release."""

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
            pool = self._cached(Pool.create_id(req.pool_id), lambda: self._pool(req.pool_id))
            # first and cheapest: a flood is refused before it costs a read or a decision
            bucket = self.request_rate.admit(pool, tenant, now)
            if charged is not None:
                charged.append(bucket)
            policy_id = TenantPolicy.create_id(req.pool_id, tenant)
            policy = self._cached(policy_id, lambda: self.find(TenantPolicy, policy_id))
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
                self._reservation(req.pool_id, req.reservation_id, tenant=tenant)
            retries = retry_policy(pool, req)
            after = dependencies(self, tenant, req)
            pairs = each_dependency(self, tenant, req, size)
            book = (tenant, req.pool_id)
            if self.queue_book.queued(book) + size > pool.config.max_queued_leases:
                self.queue_book.recount(book, self.last_topics)  # near it: what still waits
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
            self.save(*leases)
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
        members = self._with_gang(lease, LeaseState.RESERVED)
        nodes = [str(m.node_id) for m in members]
        for member in members:
            job_of = member_job(member, spec, nodes)
            self._admit_job(member, job_of)
            member.commit(now, job_of)
        self.save(*members)
        return lease

    def _admit_job(self, lease: Lease, spec: JobSpec | None) -> None:
        """The pool's image policy, checked against the node the lease holds: raises
        ImageNotAllowed before anything is recorded."""
        pool = self._pool_settings(lease.pool_id)
        node = None if lease.node_id is None else self.find(Node, Node.create_id(lease.node_id))
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
        lease = self._lease(tenant, lease_id)
        members = self._with_gang(lease, *WORKLOAD_STATES)  # members share their epoch
        # only the members it is news for are saved: a flood appends nothing (domain decides)
        beaten = [m for m in members
                  if m.heartbeat(now, epoch=body.epoch, checkpoint_at=body.last_checkpoint_at)]
        if beaten:
            self.save(*beaten)
        return lease

    @retried
    def renew(self, tenant: str, lease_id: str, body: v1.RenewLease) -> Lease:
        now = self.clock()
        lease = self._lease(tenant, lease_id)
        members = self._with_gang(lease, LeaseState.RUNNING)
        step = self._pool_settings(lease.pool_id).config.renew_step_seconds
        for member in members:
            member.renew(now, body.extend_seconds, step_seconds=step)
        # a renewal that moved no deadline by the pool's step recorded nothing: nothing to save
        moved = [m for m in members if m.pending_events]
        if moved:
            self.save(*moved)
        return lease

    @retried
    def open_session(self, tenant: str, lease_id: str, body: SessionOpen) -> Lease:
        """Record an interactive session into the tenant's running lease; the dispatcher tells
        the lease's node from the event (docs/exec.md)."""
        lease = self._lease(tenant, lease_id)
        lease.open_session(self.clock(), session_id=body.session_id, kind=body.kind,
                           command=tuple(body.command), tty=body.tty, port=body.port,
                           rows=body.rows, cols=body.cols)
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
            pool = self._pool_settings(lease.pool_id)
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
        node_id = lease.node_id  # a retried attempt forgets its placement
        lease.release(now, body.exit_code)
        self.save(lease, *self._settle(lease, now, node_id))
        return lease

    @retried
    def cancel(self, tenant: str, lease_id: str, body: v1.CancelLease) -> Lease:
        now = self.clock()
        lease = self._lease(tenant, lease_id)
        changed: list[Aggregate] = []
        cache: dict[UUID, Aggregate] = {}
        # a gang is withdrawn or stopped whole (members on their way out already go)
        for member in self._with_gang(lease, *CANCELLABLE):
            member.cancel(now, body.reason or "cancelled")
            changed.append(member)
            if not member.holds_capacity:
                changed += self._settle(member, now, cache=cache)
        self.save(*list({a.id: a for a in changed}.values()))
        return lease

    @retried
    def reconcile_due(self, lease_id: str) -> str | None:
        """A lease's deadline timer fired: end a lease that waited its queue timeout
        (`queue_timeout`), void an uncommitted reservation (capacity and hold returned) or
        expire a silent lease into `reconciling` (capacity kept until the agent confirms).
        Returns what was done, or None when nothing was due (a renewed lease)."""
        now = self.clock()
        try:
            lease = self.find(Lease, UUID(lease_id))
        except ValueError:
            return None
        if lease is None:
            return None
        if lease.state is LeaseState.HELD:  # a backoff over, or a dependency's lease ended
            return resolve_held(self, lease, now)
        reason = lease.expiry_due(now)
        if reason is None:
            return None
        if lease.state is LeaseState.QUEUED:
            # waited its queue timeout: it leaves the queue, and a gang's waiting members too
            members = self._with_gang(lease, LeaseState.QUEUED)
            for member in members:
                member.reject(now, reason, ["queue_timeout_seconds"])
            self.save(*members)
            return reason
        if lease.state is LeaseState.RESERVED:
            lease.void_reservation(now)
            # the tenant's policy remembers it, in the same save (Pool.admit_after_voids)
            policy = self.find(TenantPolicy, TenantPolicy.create_id(lease.pool_id,
                                                                   lease.tenant_id))
            noted = self._pool_settings(lease.pool_id).note_voided_reservation(policy, now)
            self.save(lease, *self._settle(lease, now), policy if noted else None)
            return "voided"
        lease.expire(now, reason)
        lease.begin_reconciliation(now)
        # a gang member's running peers go with it (one notice, one grace), in this save
        peers = self._gang_peers_noticed(
            [lease], now, self._pool(lease.pool_id).config.preemption.grace_seconds
        ) if lease.gang is not None else []
        self.save(lease, *peers)
        return f"expired:{reason}"

    def lease_next_due(self, lease_id: str) -> float | None:
        """When the lease's deadline timer should next fire (None: nothing pending)."""
        try:
            lease = self.find(Lease, UUID(lease_id))
        except ValueError:
            return None
        due = None if lease is None else lease.next_due_at()
        return due if due is not None and due > self.clock() else None

    def get(self, tenant: str, lease_id: str) -> Lease:
        return self._lease(tenant, lease_id)

    async def request_leases_async(self, tenant: str, req: v1.LeaseRequest, *,
                                   trace_parent: str | None = None) -> list[Lease] | None:
        """`request_leases` on the bus's loop for a new request whose pool and policy are
        cached; None for anything that needs a read (a retry, a refusal, a cold cache): the
        caller then runs `request_leases` on a thread, and the token it took is given back
        (one request, one token)."""
        charged: list[tuple[str, str]] = []
        try:
            made = await self.on_loop(lambda: self.request_leases(
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
        hit = self._policies.get(Pool.create_id(pool_id))
        if hit is not None:
            self.request_rate.give_back(charged, hit[0])
