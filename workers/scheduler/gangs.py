"""The planner's gangs: every member of a gang reserved in one plan (one atomic batch), or
none."""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Protocol
from uuid import UUID

from domain.account import Account
from domain.gang import GangMembership
from domain.lease import Lease, LeaseState
from domain.policy import reasons as R
from domain.policy.backfill import Backfill, placed_end_estimate
from domain.policy.fairness import PendingRequest
from domain.policy.gang import Candidate, MemberPlacement, place_gang, place_members
from domain.policy.preemption import PreemptionPlan, choose_victims
from domain.pool import Pool
from domain.reservation import Withheld
from domain.resources import ZERO, LeaseId, NodeId, Resources, Shape
from workers.pending import QueuedLease
from workers.quotas import quota_wait
from workers.scheduler.plan import (
    Plan,
    PlanState,
    Settings,
    add_hold,
    devices_for,
    topology,
    whole,
)
from workers.scheduler.preemption import Preemption
from workers.scheduler.state import (
    LEAVING,
    PendingPreemption,
    PoolState,
    allowed_trust,
    class_rank,
)


class Pass(Protocol):
    """What of the planner's pass over a pool a gang's placement uses (PoolPass)."""

    planner: Settings
    state: PlanState
    ps: PoolState
    now: float
    plan: Plan
    unplaced: list[PendingRequest]
    preemption: Preemption

    def hold_and_available(self, pool: Pool, tenant: str,
                           lease: Lease | QueuedLease) -> tuple[int, int]: ...

    def take_plan_budget(self) -> bool: ...

    def notice(self, ps: PoolState, plan: PreemptionPlan, now: float, *,
               reason: str = ...) -> list[Lease]: ...

Member = Lease | QueuedLease
GANG_BROKEN = "gang_broken"
GANG_MEMBERS_LEAVING = "gang_members_leaving"


class Gangs:
    """A gang is placed when the fair queue reaches any of its members: all of them at once
    (the others leave the queue with it), in one plan, or all wait with one reason. One per
    pool pass (`p`)."""

    def __init__(self, p: Pass) -> None:
        self.p = p
        self.state = p.state
        self._topology = topology(p.state)

    def place(self, req: PendingRequest, lease: Member, gang: GangMembership) -> None:
        """Place `req`'s whole gang, reject it whole, or leave every member waiting (the pass
        gave it a plan with room for every member's lease, node and account event)."""
        p = self.p
        ps, now, plan, unplaced = p.ps, p.now, p.plan, p.unplaced
        members, waiting = self._gather_gang(ps, req, lease, gang)
        queued = [m for m in members if m is not None and m.state is LeaseState.QUEUED]
        if len(queued) < gang.size:
            self._gang_incomplete(gang, members, queued, waiting, now, plan, unplaced)
            return
        pool = ps.pool
        allowed = allowed_trust(pool, queued[0].requested_shape.runtime, req.tenant)
        shapes = [m.requested_shape for m in queued]
        total = sum((s.resources for s in shapes), ZERO)
        if ps.book.limited(req.tenant):
            whole_req = dataclasses.replace(
                req, shape=dataclasses.replace(req.shape, resources=total))
            why_quota = quota_wait(p, ps, whole_req, lease, now)
            if why_quota is not None:
                self._gang_waits(waiting, why_quota, unplaced)
                return
        blocked = ps.gang_holds.blocked(now, except_for=gang.gang_id)
        blocked |= self._kept_from(ps, gang, lease, shapes, now)
        decision = place_members(gang.spec(), shapes, ps.table, self._topology,
                                 packing=pool.config.packing, allowed_trust_levels=allowed,
                                 blocked=blocked)
        if decision.never_fits:
            self._reject_gang(ps, queued, decision, now, plan)
        elif not decision.placed:
            why = self._gang_capacity_wait(ps, req, gang, shapes, total, allowed, blocked,
                                           decision, now, plan)
            self._gang_waits(waiting, why, unplaced)
        else:
            self._reserve_gang(ps, req, gang, queued, decision.nodes, now, plan, waiting,
                               unplaced)

    def _gather_gang(self, ps: PoolState, req: PendingRequest, lease: Member,
                     gang: GangMembership) -> tuple[list[Member | None], list[PendingRequest]]:
        """Every member of `req`'s gang in member order (None: gone from memory), and the
        queued requests of all of them: the others leave the queue with this one, placed
        together, or back together."""
        assert ps.queue is not None
        ids = gang.member_ids(lease.tenant_id)
        members: list[Member | None] = []
        for uid in ids:
            got = self.state.aggregates.peek(uid)
            members.append(got if isinstance(got, (Lease, QueuedLease)) else None)
        waiting = [req]
        for uid in ids:
            lid = str(uid)
            if lid != req.lease_id and lid in ps.queue:
                other = ps.queue.remove(lid)
                if other is not None:
                    waiting.append(other)
        return members, waiting

    def _gang_incomplete(self, gang: GangMembership, members: list[Member | None],
                         queued: list[Member], waiting: list[PendingRequest], now: float,
                         plan: Plan, unplaced: list[PendingRequest]) -> None:
        """A gang with members not queued: rejected whole when one ended on its own (it can
        never be whole again), else it waits for those still leaving an earlier placement."""
        # ended members have left memory (None) or are terminal
        between = sum(m is not None and m.state in _BETWEEN for m in members)
        if len(queued) + between < gang.size:
            why = f"{GANG_BROKEN}: {gang.size - len(queued) - between} of {gang.size} " \
                  "member(s) ended"
            for m in queued:
                got = whole(self.state, plan, m)
                got.reject(now, GANG_BROKEN, [why])
                self._reason(plan, str(m.id), {"gang": why, "never_satisfiable": True})
                plan.aggregates.append(got)
                plan.rejected.append(str(m.id))
            return
        why = (f"{GANG_MEMBERS_LEAVING}: {gang.size - len(queued)} of {gang.size} member(s) "
               "still hold an earlier placement")
        self._gang_waits(waiting, {"tenant": [R.WAITING_FOR_CAPACITY], "gang": why}, unplaced)

    def _reject_gang(self, ps: PoolState, queued: list[Member], decision: MemberPlacement,
                     now: float, plan: Plan) -> None:
        """A gang no nodes of the pool could ever take together: every member rejected."""
        never = {"gang": decision.reason, "filters": decision.filters,
                 "nodes_total": len(ps.table), "never_satisfiable": True}
        for m in queued:
            got = whole(self.state, plan, m)
            got.reject(now, "unschedulable", sorted({*decision.filters, str(decision.reason)}))
            self._reason(plan, str(m.id), dict(never))
            plan.aggregates.append(got)
            plan.rejected.append(str(m.id))

    def _gang_capacity_wait(self, ps: PoolState, req: PendingRequest, gang: GangMembership,
                            shapes: list[Shape], total: Resources,
                            allowed: tuple[str, ...] | None, blocked: set[str],
                            decision: MemberPlacement, now: float, plan: Plan
                            ) -> dict[str, Any]:
        """Why a gang that fits no nodes together now waits; victims may be noticed on its
        behalf (added to `plan`), and its best nodes held for it (the starvation guard)."""
        waits: dict[str, Any] = {
            "tenant": [R.WAITING_FOR_CAPACITY], "gang": decision.reason,
            "filters": decision.filters, "nodes_total": len(ps.table)}
        preempting = self._gang_preemption(ps, req, gang, shapes, total, allowed, blocked,
                                           now, plan)
        if preempting is not None:
            waits["tenant"] = [R.WAITING_FOR_PREEMPTION]
            waits["preemption"] = preempting
        held = self._gang_hold(ps, gang, decision.best_nodes, shapes, now)
        if held:
            waits["gang_hold"] = held
        return waits

    def _reserve_gang(self, ps: PoolState, req: PendingRequest, gang: GangMembership,
                      queued: list[Member], nodes: tuple[str, ...], now: float, plan: Plan,
                      waiting: list[PendingRequest], unplaced: list[PendingRequest]) -> None:
        """Every member reserved on its node, once the tenant can pay for all of them and
        each node has its member's GPU devices; else all of them wait. Its hold ends."""
        pool = ps.pool
        holds = [pool.hold_for(m.requested_shape, m.maximum_runtime_seconds)
                 for m in queued]
        acc = self.state.aggregates.get(_account_id(req.tenant))
        available = (acc.available - plan.held.get(req.tenant, 0)
                     if isinstance(acc, Account) else 0)
        if sum(holds) > available:
            self._gang_waits(waiting, {"tenant": [R.INSUFFICIENT_CREDITS],
                                       "hold_microcredits": sum(holds),
                                       "available_microcredits": available}, unplaced)
            return
        devices: list[tuple[str, ...]] = []
        for m, node_id in zip(queued, nodes, strict=True):
            got = devices_for(self.state, plan, node_id, m.requested_shape)
            if got is None:
                self._gang_waits(waiting, {"tenant": [R.WAITING_FOR_CAPACITY],
                                           "devices": f"too few free GPU devices of node "
                                                      f"{node_id} fit"}, unplaced)
                return
            devices.append(got)
        for m, node_id, hold, devs in zip(queued, nodes, holds, devices, strict=True):
            self._reserve_member(ps, m, node_id, hold, devs, now, plan)
        ps.gang_holds.release(gang.gang_id)
        ps.gang_hold_need.pop(gang.gang_id, None)

    def _gang_preemption(self, ps: PoolState, req: PendingRequest, gang: GangMembership,
                         shapes: list[Shape], total: Resources,
                         allowed: tuple[str, ...] | None, blocked: set[str], now: float,
                         plan: Plan) -> dict[str, Any] | None:
        """Preemption on a waiting gang's behalf, when the pool allows it: the busy nodes
        whose running leases the policy would give up for one member (as for a lone request:
        lower classes, or tenants over their share), counted as fitting beside the free ones;
        if the gang policy then finds it nodes, the victims on those nodes are noticed (added
        to `plan`) and the gang waits for them. One plan at a time per gang; returns where it
        stands, for `why`, or None."""
        prem = ps.pool.config.preemption
        if not prem.enabled:
            return None
        pending = self.state.preempting_for.get(gang.gang_id)
        if pending is not None:
            leaving = [v for v in pending.victims
                       if isinstance(vl := self.state.aggregates.get(UUID(v)), Lease)
                       and vl.state in LEAVING]
            if leaving:
                return {"node_id": pending.node_id, "victims": list(pending.victims)}
            del self.state.preempting_for[gang.gang_id]
        planner = self.p.planner
        if planner.plans_left <= 0:
            return None
        planner.plans_left -= 1
        shape = max(shapes, key=lambda sh: (sh.resources.gpu_count, sh.resources.cpu_millis,
                                            sh.resources.memory_mib))
        fr = ps.table.filter(shape, allowed_trust_levels=allowed)
        busy = [c for i in fr.busy
                if (nid := ps.table.node_id_at(int(i))) not in blocked
                and (c := self.p.preemption.candidate(ps, nid)).leases]
        if not busy:
            return None
        whole_req = dataclasses.replace(
            req, shape=dataclasses.replace(req.shape, resources=total))
        over = self.p.preemption.tenants_over_share(ps, whole_req, busy)
        rank = class_rank(ps.pool, req.priority_class)
        plans = {}
        for c in busy:
            chosen = choose_victims(shape, [c], rank, over, prem.min_runtime_seconds, now,
                                    requester_tenant=req.tenant)
            if chosen is not None and chosen.victims:
                plans[c.node_id] = chosen
        if not plans:
            return None
        free = [ps.table.node_id_at(int(i)) for i in fr.eligible]
        cheap = sorted(plans, key=lambda n: (plans[n].work_lost_seconds, n))
        candidates = [Candidate(node_id=n, labels=self._topology(n))
                      for n in [*(n for n in free if n not in blocked), *cheap]]
        decision = place_gang(gang.spec(), candidates)
        if not decision.placed:
            return None
        noticed: list[Lease] = []
        for node_id in decision.nodes:
            if node_id in plans:
                noticed += self.p.preemption.notice(ps, plans[node_id], now, plan)
        if not noticed:
            return None
        plan.aggregates += noticed
        nodes = sorted({str(v.node_id) for v in noticed})
        pending = PendingPreemption(",".join(nodes), tuple(str(v.id) for v in noticed))
        self.state.preempting_for[gang.gang_id] = pending
        return {"node_id": pending.node_id, "victims": list(pending.victims)}

    def _kept_from(self, ps: PoolState, gang: GangMembership, lease: Member,
                   shapes: list[Shape], now: float) -> set[str]:
        """The nodes a member may not take now, as lone requests may not: where it would run
        into an advance reservation, a maintenance window or another gang's hold (its own
        hold, or the advance reservation it names, excepted). A blocked head's backfill
        reservation does not keep a gang out: a gang is never a head itself, so a later lone
        request would otherwise take its place in line (the gang's hold is its guard)."""
        bf = ps.backfill
        if bf is None:
            return set()
        nodes = bf.window_nodes()
        if not nodes:
            return set()
        cfg = ps.pool.config
        need = _largest(shapes)
        end = placed_end_estimate(now, cfg.commit_timeout_seconds,
                                  lease.maximum_runtime_seconds)
        own = (f"gang:{gang.gang_id}" if gang.gang_id in ps.gang_holds.holds
               else self.state.windows.usable(ps.pool.pool_id, lease, now))
        return {n for n in nodes if not bf.admits(n, need, end, window=own, heads=False)}

    def _gang_hold(self, ps: PoolState, gang: GangMembership, nodes: tuple[str, ...],
                   shapes: list[Shape], now: float) -> dict[str, Any] | None:
        """The starvation guard, live: the first gang found waiting while no other holds
        keeps the fitting nodes of its best domain (widened as more free up) from other
        placements, for at most LIVE_HOLD_SECONDS, then may not hold again for as long
        (domain.policy.gang.GangHolds). Returns what it holds, for `why`."""
        holds = ps.gang_holds
        if not nodes or any(g != gang.gang_id for g in holds.holds):
            return None
        if not holds.hold(gang.gang_id, nodes, now):
            return None  # cooling down after a hold that ran out
        # what each held node keeps: the largest member's amount
        ps.gang_hold_need[gang.gang_id] = _largest(shapes)
        since, held = holds.holds[gang.gang_id]
        return {"nodes": sorted(held), "until": since + holds.max_hold_seconds}

    def _reserve_member(self, ps: PoolState, member: Member, node_id: str, hold: int,
                        devices: tuple[str, ...], now: float, plan: Plan) -> None:
        """One member reserved on its node, as a lone placement is (no job restarts on its
        own: a gang's jobs start on the holder's commit, which tells each its peers' nodes)."""
        lease = whole(self.state, plan, member)
        lid = LeaseId(str(lease.id))
        epoch = lease.reserve(now, node_id=NodeId(node_id),
                              commit_timeout_seconds=ps.pool.config.commit_timeout_seconds,
                              hold_microcredits=hold, devices=devices)
        res: Resources = lease.requested_shape.resources
        plan.allocations.setdefault(node_id, []).append((lid, res, devices))
        plan.aggregates.append(lease)
        if hold:
            add_hold(plan, lease.tenant_id, lid, epoch, hold)
        ps.table.allocate(node_id, lid, res, tenant=lease.tenant_id)
        if ps.backfill is not None:
            ps.backfill.placed(lid)
        self.state.track(ps, lease)
        self.state.reasons.pop(lid, None)
        heapq.heappush(self.state.deadlines, (lease.reservation_deadline or now, lid))
        plan.reserved.append(lease)

    def _gang_waits(self, waiting: list[PendingRequest], why: dict[str, Any],
                    unplaced: list[PendingRequest]) -> None:
        for r in waiting:
            self._reason(self.p.plan, r.lease_id, dict(why))
            unplaced.append(r)

    def _reason(self, plan: Plan, lease_id: str, why: dict[str, Any]) -> None:
        self.state.reasons[lease_id] = plan.reasons[lease_id] = why


# a member on its way back to the queue (or not yet in it): its gang waits for it
_BETWEEN = frozenset({LeaseState.REQUESTED, LeaseState.RESERVED, LeaseState.RUNNING,
                      LeaseState.STOPPING, LeaseState.PREEMPTING, LeaseState.EXPIRED,
                      LeaseState.RECONCILING})


def _largest(shapes: list[Shape]) -> Resources:
    """The largest member's amount (by GPUs, then CPU, then memory)."""
    return max((s.resources for s in shapes),
               key=lambda r: (r.gpu_count, r.cpu_millis, r.memory_mib))


def _account_id(tenant: str) -> UUID:
    return Account.create_id(tenant)


def hold_for_gangs(ps: PoolState, bf: Backfill, now: float) -> None:
    """At a cycle's start: drop the holds of gangs no longer queued (placed, cancelled,
    rejected) or past their time, and give backfill what the rest keep on each node, so
    lone placements stay out of it as they stay out of a maintenance window."""
    holds = ps.gang_holds
    if not holds.holds:
        return
    assert ps.queue is not None
    for gang_id in list(holds.holds):
        if gang_id not in ps.queue:  # the lead's lease id is the gang's id
            holds.release(gang_id)
    holds.blocked(now)  # lets holds past their time lapse
    for gang_id in list(ps.gang_hold_need):
        if gang_id not in holds.holds:
            del ps.gang_hold_need[gang_id]
    bf.withhold_also(
        Withheld(reservation_id=f"gang:{gang_id}", node_id=node_id, start_at=now,
                 resources=ps.gang_hold_need[gang_id],
                 end_at=since + holds.max_hold_seconds)
        for gang_id, (since, nodes) in holds.holds.items()
        if gang_id in ps.gang_hold_need
        for node_id in sorted(nodes) if node_id in ps.table)
