"""The planner's preemption: victims chosen and noticed for waiting requests (no I/O: the
notices are leases' events in the plan)."""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING
from uuid import UUID

from workers.pending import QueuedLease
from workers.quotas import may_be_victim
from workers.scheduler.state import LEAVING, PendingPreemption, PoolState, class_rank

log = logging.getLogger(__name__)
from domain.errors import DomainError
from domain.gang import with_members
from domain.lease import Lease, LeaseState
from domain.policy.fairness import PendingRequest, weighted_dominant_share
from domain.policy.placement import FilterResult
from domain.policy.preemption import (
    PREEMPTED,
    NodeCandidate,
    PreemptionPlan,
    RunningLease,
    choose_victims,
)
from domain.resources import ZERO, Resources

if TYPE_CHECKING:
    from workers.scheduler.plan import Plan, PlanState


class Preemption:
    """Preemption planned for a waiting request over `state`: victims chosen and noticed."""

    def __init__(self, state: PlanState) -> None:
        self.state = state

    def pending(self, lease_id: str) -> PendingPreemption | None:
        """The request's earlier preemption while any of its victims still holds capacity on
        that node; preempting again meanwhile would stop more work than the request needs."""
        pending = self.state.preempting_for.get(lease_id)
        if pending is None:
            return None
        for vid in pending.victims:
            victim = self.state.aggregates.get(UUID(vid))
            # a victim back in `running` means the notice never landed (a lost save): replan
            if (isinstance(victim, Lease) and victim.state in LEAVING
                    and victim.node_id == pending.node_id):
                return pending
        del self.state.preempting_for[lease_id]  # all freed: placement (or a new plan) takes over
        return None

    def plan_for(
        self, ps: PoolState, req: PendingRequest, lease: Lease | QueuedLease, fr: FilterResult,
        now: float,
    ) -> PreemptionPlan | None:
        if not fr.busy.size:
            return None
        candidates = [
            c for i in fr.busy if (c := self.candidate(ps, ps.table.node_id_at(int(i)))).leases
        ]
        if not candidates:
            return None
        plan = choose_victims(
            lease.requested_shape,
            candidates,
            class_rank(ps.pool, req.priority_class),
            self.tenants_over_share(ps, req, candidates),
            ps.pool.config.preemption.min_runtime_seconds,
            now,
            requester_tenant=req.tenant,
        )
        return plan if plan is not None and plan.victims else None

    def candidate(self, ps: PoolState, node_id: str) -> NodeCandidate:
        """A busy node as the preemption policy sees it: only running, preemptible leases
        can be victims (reserved ones have no work to lose yet, preempting ones are going)."""
        victims: list[RunningLease] = []
        for lid in ps.table.leases_on(node_id):
            lease = self.state.aggregates.get(UUID(lid))
            if (not isinstance(lease, Lease) or lease.state is not LeaseState.RUNNING
                    or not may_be_victim(ps, lease) or lease.started_at is None):
                continue
            victims.append(RunningLease(
                lease_id=lid,
                tenant=lease.tenant_id,
                priority_rank=class_rank(ps.pool, lease.priority_class),
                resources=lease.resources,
                started_at=lease.started_at,
                last_checkpoint_at=lease.last_checkpoint_at,
                # a lease that reported a checkpoint can resume from it; one that never did
                # loses everything since it started
                checkpointable=lease.checkpointable or lease.last_checkpoint_at is not None,
            ))
        return NodeCandidate(node_id, ps.table.free_resources(node_id), tuple(victims))

    def tenants_over_share(
        self, ps: PoolState, req: PendingRequest, candidates: list[NodeCandidate]
    ) -> set[str]:
        """Tenants whose weighted dominant share exceeds the requester's once this request is
        placed: the strict comparison after placement keeps two equal tenants from evicting
        each other back and forth."""
        queue = ps.queue
        assert queue is not None
        totals = ps.table.totals(ready_only=True)

        def share(tenant: str, extra: Resources = ZERO) -> float:
            return weighted_dominant_share(queue.usage(tenant) + extra, totals,
                                           ps.weights.get(tenant, 1.0))

        mine = share(req.tenant, req.shape.resources)
        tenants = {v.tenant for c in candidates for v in c.leases} - {req.tenant}
        return {t for t in tenants if share(t) > mine}

    def notice(
        self, ps: PoolState, plan: PreemptionPlan, now: float, out_plan: Plan,
        *, reason: str = PREEMPTED,
    ) -> list[Lease]:
        """Notice each victim (the ones the domain accepted are returned, to be saved)."""
        prem = ps.pool.config.preemption
        out: list[Lease] = []
        chosen = set(plan.victim_ids)
        # a gang member's whole gang goes with it: one notice, one grace for every member
        for vid in with_members(plan.victim_ids, self.state.aggregates.get):
            victim = self.state.aggregates.get(UUID(vid))
            if not isinstance(victim, Lease) or (
                    vid not in chosen and victim.state is not LeaseState.RUNNING):
                continue
            try:
                grace_deadline = victim.notice_preemption(
                    now,
                    grace_seconds=prem.grace_seconds,
                    # its own wish: back in line, or ended as preempted
                    requeue=victim.requeue_when_preempted,
                    reason=reason,
                    min_runtime_seconds=prem.min_runtime_seconds,
                )
            except DomainError:
                log.exception("could not notice preemption of lease %s", vid)
                continue
            out.append(victim)
            # our own write is not re-indexed on catch-up: wake the sweep at the grace deadline
            heapq.heappush(self.state.deadlines, (grace_deadline, vid))
            out_plan.preempted += 1
        return out
