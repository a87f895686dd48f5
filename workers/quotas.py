"""The scheduler's quota gate: admission by nominal quota and cohorts, reclaim, restart on requeue.
Functions of the scheduler's state, kept apart so its cycle stays short; rules: docs/quotas.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol
from uuid import UUID

from domain.errors import DomainError
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.policy import reasons as R
from domain.policy.fairness import PendingRequest, weighted_dominant_share
from domain.policy.preemption import RECLAIMING_QUOTA, PreemptionPlan, RunningLease
from domain.resources import Resources
from workers.application import WEIGHT_SCALE

if TYPE_CHECKING:
    from domain.policy.fairness import DecayedUsage, FairQueue
    from domain.pool import Pool
    from domain.quota import QuotaBook
    from workers.pending import LeaseMemory, QueuedLease

log = logging.getLogger(__name__)


class PoolState(Protocol):
    """What of the scheduler's per-pool state the gate reads (workers.scheduler.PoolState)."""

    pool: Pool
    queue: FairQueue | None
    book: QuotaBook
    protected: set[str]
    decay: DecayedUsage
    weights: dict[str, float]

    @property
    def table(self) -> Any: ...


class Held(Protocol):
    """What of the scheduler's fold the gate reads (workers.scheduler.folding)."""

    aggregates: LeaseMemory
    usage: dict[str, tuple[str, Resources]]


class Planning(Protocol):
    """What of the planner's pass over a pool the gate uses (workers.scheduler.placing)."""

    @property
    def state(self) -> Held: ...

    def hold_and_available(self, pool: Pool, tenant: str,
                           lease: Lease | QueuedLease) -> tuple[int, int]: ...

    def take_plan_budget(self) -> bool: ...

    def notice(self, ps: Any, plan: PreemptionPlan, now: float, *,
               reason: str = ...) -> list[Lease]: ...


_LEAVING = frozenset({LeaseState.PREEMPTING, LeaseState.STOPPING})


def may_be_victim(ps: PoolState, lease: Lease) -> bool:
    """Neither the lease, its tenant (as set now) nor its priority class is non-preemptible."""
    return (lease.preemptible and lease.tenant_id not in ps.protected
            and ps.pool.config.class_preemptible(lease.priority_class))


def quota_wait(s: Planning, ps: PoolState, req: PendingRequest, lease: Lease | QueuedLease,
               now: float) -> dict[str, Any] | None:
    """None when the request fits its tenant's quota; else why it waits, naming whose
    borrowing blocks it, and credits too when it could not pay either. An owner asking only
    for its own nominal quota has borrowers' leases noticed (reason `reclaiming_quota`, in
    the pass's plan), unless the cohort says never."""
    assert ps.queue is not None
    usage = ps.queue.usages()
    res = req.shape.resources
    verdict = ps.book.check(req.tenant, res, usage)
    if verdict.fits:
        return None
    why: dict[str, Any] = {"tenant": [R.QUOTA_EXCEEDED], "quota": verdict.to_dict()}
    hold, available = s.hold_and_available(ps.pool, req.tenant, lease)
    if hold > available:  # both reasons apply: name both, and reclaim nothing for it
        why["tenant"].append(R.INSUFFICIENT_CREDITS)
        why.update(hold_microcredits=hold, available_microcredits=available)
        return why
    quota = ps.book.tenants[req.tenant]
    cohort = ps.book.cohorts.get(quota.cohort or "")
    if not verdict.may_reclaim or cohort is None or cohort.reclaim == "never":
        return why
    # a scan of the cohort's leases is bounded per cycle, as preemption plans are
    if not s.take_plan_budget():
        return why
    members = {m.tenant for m in ps.book.members(cohort.name)} - {req.tenant}
    running: list[RunningLease] = []
    leaving: list[str] = []
    after = dict(usage)
    for lid, (tenant, amount) in list(s.state.usage.items()):
        if tenant not in members:
            continue
        other = s.state.aggregates.get(UUID(lid))
        if not isinstance(other, Lease) or other.pool_id != ps.pool.pool_id:
            continue
        if other.state in _LEAVING:
            leaving.append(lid)  # already on its way out: no longer counted
            after[tenant] = after.get(tenant, Resources()) - amount
        elif (other.state is LeaseState.RUNNING and other.started_at is not None
              and may_be_victim(ps, other)
              and now - other.started_at >= ps.pool.config.preemption.min_runtime_seconds):
            running.append(RunningLease(
                lease_id=lid, tenant=tenant, priority_rank=0, resources=amount,
                started_at=other.started_at, last_checkpoint_at=other.last_checkpoint_at,
                checkpointable=other.checkpointable or other.last_checkpoint_at is not None))
    if ps.book.check(req.tenant, res, after).fits:
        why["tenant"].append(R.WAITING_FOR_RECLAIM)
        why["reclaim"] = {"victims": sorted(leaving)}
        return why
    full = set(verdict.cohort_full)
    chosen: list[RunningLease] = []
    # least work lost first; a lease is taken only while its tenant still borrows in a
    # dimension the request is short of
    for victim in sorted(running, key=lambda v: (v.work_lost(now), v.lease_id)):
        borrowing = ps.book.borrowing(victim.tenant, after.get(victim.tenant, Resources()))
        if not full.intersection(d for d in borrowing if victim.resources.get(d)):
            continue
        chosen.append(victim)
        after[victim.tenant] = after[victim.tenant] - victim.resources
        if ps.book.check(req.tenant, res, after).fits:
            break
    else:
        return why  # borrowers it may not preempt hold the rest: wait for them to finish
    plan = PreemptionPlan("", tuple(chosen), sum(v.work_lost(now) for v in chosen))
    noticed = s.notice(ps, plan, now, reason=RECLAIMING_QUOTA)
    why["tenant"].append(R.WAITING_FOR_RECLAIM)
    why["reclaim"] = {"victims": sorted(leaving + [str(v.id) for v in noticed])}
    return why


def restart_job(aggregates: LeaseMemory, ps: PoolState, lease: Lease, node_id: str,
                now: float) -> bool:
    """Commit a just-reserved lease whose interrupted job restarts on its own, the pool's image
    policy checked again against the new node. False (left reserved for the tenant to commit
    or let lapse) when the policy now refuses the job."""
    job = lease.job
    assert job is not None
    node = aggregates.get(Node.create_id(node_id))
    try:
        ps.pool.admit_image(job.spec.image or None, signature=job.spec.image_signature,
                            size_bytes=job.spec.image_size_bytes, tenant=lease.tenant_id,
                            node_trust=node.capabilities.trust_level
                            if isinstance(node, Node) else None,
                            isolation=lease.shape.runtime)
        lease.commit(now)
    except DomainError as e:
        log.warning("lease %s: its job does not restart on its own (%s)", lease.id, e)
        return False
    return True


# Fair share that remembers ------------------------------------------------------------------


def _changed_at(lease: Lease) -> float | None:
    """When the lease's hold on capacity last began or ended, from its own events."""
    if lease.holds_capacity:
        return lease.reserved_at
    return lease.ended_at if lease.ended_at is not None else lease.queued_at


def remember_usage(ps: PoolState, lease: Lease) -> None:
    """Its tenant's usage changed with `lease`: the decayed record takes the new usage from the
    time the lease's event says (never the clock: a replay gives the same history)."""
    assert ps.queue is not None
    at = _changed_at(lease)
    if at is not None:
        ps.decay.set_usage(lease.tenant_id, at, ps.queue.usage(lease.tenant_id))


def apply_history(ps: PoolState, now: float) -> None:
    """Give the fair queue every tenant's decayed past usage at `now`, as a dominant share."""
    assert ps.queue is not None
    totals = ps.table.totals(ready_only=True)
    for tenant in ps.decay.tenants():
        ps.queue.set_history(tenant, ps.decay.share(tenant, now, totals))


def fair_shares(ps: PoolState, now: float) -> dict[str, Any]:
    """Each tenant's weight, current dominant share, decayed usage and share, the ordering
    key they make, and its rank (1 goes first), as `pool shares` prints them."""
    assert ps.queue is not None
    totals = ps.table.totals(ready_only=True)
    tenants = set(ps.weights) | set(ps.queue.usages()) | set(ps.decay.tenants())
    rows = []
    for t in tenants:
        weight = ps.weights.get(t, float(WEIGHT_SCALE)) / WEIGHT_SCALE
        current = weighted_dominant_share(ps.queue.usage(t), totals, 1.0)
        past = ps.decay.share(t, now, totals)
        rows.append({"tenant": t, "weight": weight, "current_share": current,
                     "decayed_share": past, "priority": (current + past) / weight,
                     "decayed_usage": ps.decay.usage(t, now),
                     "usage": ps.queue.usage(t).to_dict()})
    rows.sort(key=lambda r: (r["priority"], r["tenant"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return {"pool_id": ps.pool.pool_id, "at": now,
            "half_life_seconds": ps.decay.half_life_seconds, "totals": totals.to_dict(),
            "tenants": rows}
