"""The planner's pass over one pool's queue: fit, fair order, backfill, waits and their
reasons, and the plans it fills (workers.scheduler.planner)."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator
from typing import Any
from uuid import UUID

from domain.lease import Lease, LeaseState
from domain.policy import reasons as R
from domain.policy.backfill import Backfill, band_of, placed_end_estimate
from domain.policy.fairness import FairQueue, PendingRequest
from domain.policy.placement import FilterResult
from domain.policy.preemption import PREEMPTED, PreemptionPlan
from domain.pool import Pool
from domain.resources import LeaseId, NodeId, Shape
from workers.pending import QueuedLease
from workers.quotas import apply_history, quota_wait, restart_job
from workers.scheduler import state as state_module
from workers.scheduler.gangs import Gangs, hold_for_gangs
from workers.scheduler.plan import (
    Plan,
    PlanState,
    Settings,
    add_hold,
    devices_for,
    hold_and_available,
    whole,
)
from workers.scheduler.preemption import Preemption
from workers.scheduler.state import (
    MAX_MESSAGES_PER_BATCH,
    PendingPreemption,
    PoolState,
    allowed_trust,
)

# what `_place_one` is given: backfill (None: the fast path), shape, lease, its id, the
# trust levels allowed, its band, now
Where = tuple[Backfill | None, Any, Lease | QueuedLease, str, tuple[str, ...] | None, Any, float]


class NothingFits:
    """A pass's early stop (`Planner.stop_when_nothing_fits`, used without backfill's admission
    and preemption): capacity only shrinks within a pass, so once every shape still queued
    has fit nowhere (among the nodes of the trust its request may use) no later request is
    placed, and popping on would only make more waits, whose reasons and positions the
    requests left unpopped keep from the cycle before."""

    def __init__(self, queue: FairQueue, pool: Pool,
                 trust: dict[tuple[str, str], tuple[str, ...] | None]) -> None:
        self.pool = pool
        self.trust = trust  # the pass's: (isolation, tenant) → trust levels allowed
        self.left: Counter[tuple[Shape, tuple[str, ...] | None]] = Counter(
            self.key(r) for r in queue.requests())
        self.missed: set[tuple[Shape, tuple[str, ...] | None]] = set()
        self.open = len(self.left)  # keys still queued that have not missed

    def key(self, req: PendingRequest) -> tuple[Shape, tuple[str, ...] | None]:
        """The request's shape and the node trust levels it may use (None: any)."""
        at = (req.shape.runtime, req.tenant)
        if at not in self.trust:
            self.trust[at] = allowed_trust(self.pool, req.shape.runtime, req.tenant)
        return req.shape, self.trust[at]

    def popped(self, req: PendingRequest) -> None:
        key = self.key(req)
        self.left[key] -= 1
        if self.left[key] == 0 and key not in self.missed:
            self.open -= 1

    def miss(self, req: PendingRequest, allowed: tuple[str, ...] | None) -> None:
        key = (req.shape, allowed)
        if key not in self.missed:
            self.missed.add(key)
            if self.left[key] > 0:
                self.open -= 1

    def done(self) -> bool:
        return self.open <= 0 and bool(self.missed)


class PoolPass:
    """One pass over a pool's queue at `now` (workers.scheduler.planner): fit, fair order,
    backfill, gangs, preemption, waits and their reasons. Iterate it for its plans."""

    def __init__(self, planner: Settings, state: PlanState, ps: PoolState, now: float) -> None:
        self.planner = planner
        self.state = state
        self.ps = ps
        self.now = now
        self.plan = Plan(ps.pool.pool_id)  # the plan being filled
        self.unplaced: list[PendingRequest] = []  # waiting, in the order examined
        self.starts: dict[str, float | None] = {}  # waiting request → estimated start
        self.waiting = 0  # requests left in line, once the pass is over
        self.preemption = Preemption(state)
        self.gangs = Gangs(self)

    def __iter__(self) -> Iterator[Plan]:
        """The pass: backfill set up, one walk over the queue yielding each plan as it fills
        (the last, perhaps empty, at the end), then the requests left waiting back in line,
        told their place."""
        queue = self.ps.queue
        if queue is None or not len(queue):
            return
        bf, guarded = self._begin_pool()
        yield from self._pass_over_queue(queue, bf, guarded)
        self._requeue(bf)
        self.waiting = len(self.unplaced)

    def _flush(self) -> Plan:
        plan, self.plan = self.plan, Plan(self.ps.pool.pool_id)
        return plan

    # what quotas' reclaim asks of a pass (workers.quotas.Planning) -----------------------

    def hold_and_available(self, pool: Pool, tenant: str,
                           lease: Lease | QueuedLease) -> tuple[int, int]:
        return hold_and_available(self.state, self.plan, pool, tenant, lease)

    def take_plan_budget(self) -> bool:
        """One preemption plan of the cycle's budget taken; False when it is spent."""
        if self.planner.plans_left <= 0:
            return False
        self.planner.plans_left -= 1
        return True

    def notice(self, ps: PoolState, plan: PreemptionPlan, now: float, *,
               reason: str = PREEMPTED) -> list[Lease]:
        """The plan's victims noticed, their events in the plan being filled."""
        noticed = self.preemption.notice(ps, plan, now, self.plan, reason=reason)
        self.plan.aggregates += noticed
        return noticed

    # ------------------------------------------------------------------------------------

    def _place_one(self, ps: PoolState, bf: Backfill | None, shape: Any,
                   lease: Lease | QueuedLease, lease_id: str,
                   allowed: tuple[str, ...] | None, band: Any, now: float,
                   ) -> tuple[str | None, FilterResult, bool]:
        """The node one lease is placed on now: through backfill's admission when `bf` is
        given (held True: it fits only where a reservation keeps it out), else the fast path."""
        cfg = ps.pool.config
        if bf is not None:
            assert ps.queue is not None
            return bf.place(
                shape, placed_end_estimate(now, cfg.commit_timeout_seconds,
                                           lease.maximum_runtime_seconds),
                packing=cfg.packing,  # type: ignore[arg-type]
                allowed_trust_levels=allowed, lease_id=lease_id,
                window=self.state.windows.usable(ps.pool.pool_id, lease, now),
                band=band, offered_later=ps.queue.__contains__)
        got, result = ps.table.place_fast(
            shape, packing=cfg.packing,  # type: ignore[arg-type]
            allowed_trust_levels=allowed)
        return got, result, False

    def _pass_over_queue(self, queue: FairQueue, bf: Backfill, guarded: bool
                         ) -> Iterator[Plan]:
        """Each request in fair order, until the queue is empty or the cycle's examination
        budget is spent: reserved (a plan yielded each time one is full), rejected, or left
        waiting in `unplaced` with its reasons (and in `starts`, the start it may expect)."""
        ps, now, unplaced, starts = self.ps, self.now, self.unplaced, self.starts
        state = self.state
        pool = ps.pool
        cfg = pool.config
        ranks, aging = dict(cfg.priority_classes), float(cfg.aging_seconds_per_rank)
        examined = 0
        # (isolation, tenant) → the node trust levels the pool's image policy allows it
        # (None: any), asked once per cycle rather than at every placement
        trust_of: dict[tuple[str, str], tuple[str, ...] | None] = {}
        # one pop at a time: each placement changes its tenant's share before the next pick
        limit = self.planner.max_examined_per_cycle
        stop = (NothingFits(queue, pool, trust_of) if self.planner.stop_when_nothing_fits
                and not guarded and not cfg.preemption.enabled else None)
        while (examined < limit and not (stop is not None and stop.done())
               and (req := queue.pop(now)) is not None):
            examined += 1
            if stop is not None:
                stop.popped(req)
            # a compact QueuedLease until it is rejected or reserved (`planner.whole`)
            lease = state.aggregates.peek(UUID(req.lease_id))
            if (not isinstance(lease, (Lease, QueuedLease))
                    or lease.state is not LeaseState.QUEUED):
                continue
            if ps.table.node_of(req.lease_id) is not None:
                # a node re-read from the log after a refused batch holds it: another scheduler
                # placed it and our copy of the lease is older; catch-up brings its events
                continue
            gang = lease.gang
            if gang is not None:  # all members at once, or none (workers.scheduler.gangs)
                # room for every member's lease, node and account event in one plan: this one
                # goes first when the gang would not fit in what is left of it
                if self.plan.messages + 2 * gang.size + 1 >= state_module.MAX_MESSAGES_PER_BATCH:
                    yield self._flush()
                self.gangs.place(req, lease, gang)
                continue
            shape = lease.requested_shape
            if ps.book.limited(req.tenant) and (
                    why := quota_wait(self, ps, req, lease, now)) is not None:
                self._wait(req, why, unplaced)
                continue
            # the pool's image policy decides which node trust levels this isolation may use
            trust_key = (shape.runtime, req.tenant)
            if trust_key in trust_of:
                allowed = trust_of[trust_key]
            else:
                allowed = trust_of[trust_key] = allowed_trust(pool, shape.runtime, req.tenant)
            array = lease.array_id
            if array is not None and (why := state.throttled(array, lease)) is not None:
                self._wait(req, why, unplaced)
                continue
            band = (band_of(req.priority_class, req.enqueued_at, now, ranks, aging) if guarded
                    else None)
            where = (bf if guarded else None, shape, lease, req.lease_id, allowed, band, now)
            # a retry keeps off the node its last attempt ended on, unless nothing else fits
            avoid = lease.avoid_node
            if avoid and avoid in ps.table and ps.table.state_of(avoid) == "ready":
                node_id, fr, held = self._place_avoiding(ps, avoid, where)
            else:
                node_id, fr, held = self._place_one(ps, *where)
            if node_id is None:
                if held:
                    self._held_back(ps, bf, req, fr, now, allowed, unplaced, starts)
                    continue
                if stop is not None and not fr.never_satisfiable:
                    stop.miss(req, allowed)
                self._not_placed(ps, bf, req, lease, fr, now, allowed, unplaced, starts)
            elif not self._reserve(ps, bf, req, lease, shape, node_id, band, now, unplaced):
                continue  # it waits after all, for credits or GPU devices
            # one event per lease, plus one per node placed on and one per account holding
            # credits
            if self.plan.messages >= MAX_MESSAGES_PER_BATCH:
                yield self._flush()
        yield self._flush()  # the last, perhaps empty (its save settles the one before)

    def _begin_pool(self) -> tuple[Backfill, bool]:
        """A pool's cycle begun: its usage brought up to date, and its backfill given the
        windows in force, the gangs' holds and the blocked heads' reservations. Returns the
        backfill, and whether placements go through its admission this cycle."""
        ps, now, windows = self.ps, self.now, self.state.windows
        assert ps.queue is not None
        ps.refresh_totals()
        if ps.decay.half_life_seconds:
            apply_history(ps, now)
        pool_id = ps.pool.pool_id
        if ps.backfill is None:
            ps.backfill = Backfill(ps.table, self.state.lease_end)
        bf = ps.backfill
        # windows first: the heads' reservations, made again by `begin`, stay out of them
        windows.apply(pool_id, bf, now)
        hold_for_gangs(ps, bf, now)  # a waiting head gang keeps its gathered nodes
        bf.begin(now, queued=ps.queue.__contains__)
        # windows are kept through backfill's admission, so it is used while any is in force
        guarded = (self.planner.backfill or windows.in_force(pool_id)
                   or bool(ps.gang_holds.holds))
        return bf, guarded

    def _place_avoiding(self, ps: PoolState, avoid: str, where: Where,
                        ) -> tuple[str | None, FilterResult, bool]:
        """A retry placed as `_place_one` places it, but off the node its last attempt ended
        on (`avoid`, ready), unless no other node fits it now."""
        table = ps.table
        table.set_state(avoid, "cordoned")
        try:
            elsewhere = table.place_fast(
                where[1], packing=ps.pool.config.packing,  # type: ignore[arg-type]
                allowed_trust_levels=where[4])[0] is not None
            if elsewhere:
                return self._place_one(ps, *where)
        finally:
            table.set_state(avoid, "ready")
        return self._place_one(ps, *where)

    def _held_back(self, ps: PoolState, bf: Backfill, req: PendingRequest, fr: FilterResult,
                   now: float, allowed: tuple[str, ...] | None, unplaced: list[PendingRequest],
                   starts: dict[str, float | None]) -> None:
        """A request that fits now, but only where it would delay a blocked head's
        reservation or run into an advance reservation or maintenance window (named in its
        reasons): it waits, with the start it may expect."""
        pool = ps.pool
        why = fr.wait_reasons([R.WAITING_FOR_RESERVATION]).to_dict()
        self.state.windows.explain(pool.pool_id, why)
        self._wait(req, why, unplaced)
        starts[req.lease_id] = self._start_estimate(bf, req, fr, pool.config, now, allowed)

    def _not_placed(self, ps: PoolState, bf: Backfill, req: PendingRequest,
                    lease: Lease | QueuedLease, fr: FilterResult, now: float,
                    allowed: tuple[str, ...] | None, unplaced: list[PendingRequest],
                    starts: dict[str, float | None]) -> None:
        """A request no node takes now: rejected when no node of the pool ever could, else it
        waits for credits or for capacity (with the start it may expect, and victims noticed
        on its behalf where the pool preempts)."""
        pool = ps.pool
        if fr.never_satisfiable:
            lease = whole(self.state, self.plan, lease)
            lease.reject(now, "unschedulable", sorted(fr.failures))
            self._rejected(pool.pool_id, req, fr.wait_reasons().to_dict(), now)
            self.plan.aggregates.append(lease)
            self.plan.rejected.append(req.lease_id)
            return
        hold, available = self.hold_and_available(pool, req.tenant, lease)
        if hold > available:
            # it could not pay even once capacity is free: say both, and preempt no one on
            # behalf of a request that would still wait
            why = fr.wait_reasons([R.INSUFFICIENT_CREDITS]).to_dict()
            why.update(hold_microcredits=hold, available_microcredits=available)
        else:
            why = self._capacity_wait(ps, req, lease, fr, now)
            starts[req.lease_id] = self._start_estimate(bf, req, fr, pool.config, now, allowed)
        self._wait(req, why, unplaced)

    def _reserve(self, ps: PoolState, bf: Backfill, req: PendingRequest,
                 lease: Lease | QueuedLease, shape: Shape, node_id: str, band: Any, now: float,
                 unplaced: list[PendingRequest]) -> bool:
        """A request reserved on the node found for it, once its tenant can pay and the node
        has the GPU devices: the lease's event in the plan, its node's and account's kept in
        its allocations and holds for when the plan is saved. False: it waits instead."""
        pool, plan, state = ps.pool, self.plan, self.state
        hold, available = self.hold_and_available(pool, req.tenant, lease)
        if hold > available:
            self._wait(req, {"tenant": [R.INSUFFICIENT_CREDITS],
                             "hold_microcredits": hold, "available_microcredits": available},
                       unplaced)
            return False
        devices = devices_for(state, plan, node_id, shape)
        if devices is None:
            self._wait(req, {"tenant": [R.WAITING_FOR_CAPACITY],
                             "devices": f"too few free GPU devices of node {node_id} fit"},
                       unplaced)
            return False
        lease = whole(state, plan, lease)
        restart = lease.restarts_on_placement
        epoch = lease.reserve(
            now,
            node_id=NodeId(node_id),
            commit_timeout_seconds=pool.config.commit_timeout_seconds,
            hold_microcredits=hold,
            devices=devices,
        )
        if restart and restart_job(state.aggregates, ps, lease, node_id, now):
            heapq.heappush(state.deadlines, (lease.next_due_at() or now, req.lease_id))
        lid = LeaseId(req.lease_id)
        res = shape.resources
        on_node = plan.allocations.get(node_id)
        if on_node is None:
            plan.allocations[node_id] = [(lid, res, devices)]
        else:
            on_node.append((lid, res, devices))
        plan.aggregates.append(lease)
        if hold:
            # recorded when the plan is saved, with the tenant's other holds of the plan,
            # as ONE event on its account (`Account.hold_many`)
            add_hold(plan, req.tenant, lid, epoch, hold)
        ps.table.allocate(node_id, req.lease_id, res, tenant=req.tenant)
        bf.placed(req.lease_id)
        state.track(ps, lease)
        self._reserved(ps, bf, req, band, node_id, now)  # its reasons go, its terms stay
        heapq.heappush(state.deadlines, (lease.reservation_deadline or now, req.lease_id))
        # every placement: its span (when traced) and its wait (metrics) once it is saved
        plan.reserved.append(lease)
        return True

    def _requeue(self, bf: Backfill) -> None:
        """The pass's waiting requests back in line, in the order they were examined (those
        still queued), each told its place in the queue and the start it may expect."""
        ps, now, starts = self.ps, self.now, self.starts
        assert ps.queue is not None
        queue, pool_id = ps.queue, ps.pool.pool_id
        position = 0
        for req in self.unplaced:
            lease = self.state.aggregates.peek(UUID(req.lease_id))
            if isinstance(lease, (Lease, QueuedLease)) and lease.state is LeaseState.QUEUED:
                queue.requeue(req)
                position += 1
                self._note_position(bf, req, position, starts.get(req.lease_id), pool_id, now)

    def _terms(self, ps: PoolState, bf: Backfill, req: PendingRequest, band: Any,
               now: float) -> dict[str, Any]:
        """Which policy terms chose a placement: the tenant's fair share when picked, its
        priority class (and aged band, where backfill ranks), how long it waited, and
        whether it went past a blocked head's reservation (backfill), naming each
        reservation of its band or above in force then (head, node, start, band)."""
        assert ps.queue is not None
        terms = {"share": round(ps.queue.share(req.tenant), 6),
                 "priority_class": req.priority_class, "band": band,
                 "waited_seconds": round(max(0.0, now - req.enqueued_at), 3),
                 "backfill": bool(band is not None and bf.reservations)}
        if terms["backfill"]:  # the reservations its admission kept clear (docs/audit.md)
            terms["reservations"] = [r.to_dict() for r in bf.reservations.values()
                                     if r.band >= band and r.lease_id != req.lease_id]
        return terms

    def _start_estimate(self, bf: Backfill, req: PendingRequest, fr: FilterResult,
                        cfg: Any, now: float, allowed: tuple[str, ...] | None) -> float | None:
        """When a request that waits for capacity may start: its reservation's start if it
        is (or now becomes) its band's head and backfill is on, else the earliest time the
        running leases' deadlines free enough for it on one node (a bound, not a promise);
        None for that walk when the planner's `estimate_starts` is off."""
        if self.planner.backfill:
            band = band_of(req.priority_class, req.enqueued_at, now,
                           dict(cfg.priority_classes), float(cfg.aging_seconds_per_rank))
            held = bf.blocked(req.lease_id, req.shape, band, allowed)
            if held is not None:
                return held.start_at
        if not self.planner.estimate_starts:
            return None  # no walk: the estimate only explains a wait, it places nothing
        key = (req.shape, allowed)
        if key not in bf.estimates:  # once per shape a cycle: the walk visits every candidate
            found = bf.earliest(req.shape.resources, [*fr.eligible.tolist(), *fr.busy.tolist()])
            bf.estimates[key] = None if found is None else found[0]
        return bf.estimates[key]

    def _note_position(self, bf: Backfill, req: PendingRequest, position: int,
                       start: float | None, pool_id: str, now: float) -> None:
        """Add the request's place in the pool's queue (1 = next) and its start estimate to
        its reasons, for `why`; and record the reasons if they changed."""
        lease_id = req.lease_id
        why = self.state.reasons.get(lease_id)
        if why is None:
            return
        reserved = bf.reservation_of(lease_id) if self.planner.backfill else None
        why["queue"] = {"position": position, "estimated_start_at": start,
                        "reserved": reserved is not None}
        if reserved is not None:
            why["queue"]["reserved_node_id"] = reserved.node_id
        decisions = self.state.decisions
        if decisions is not None:
            decisions.waiting(pool_id, req.tenant, lease_id, why, now)

    def _rejected(self, pool_id: str, req: PendingRequest, why: dict[str, Any],
                  now: float) -> None:
        """A request no node of the pool can ever take: its reasons kept, and recorded."""
        self.state.reasons[req.lease_id] = self.plan.reasons[req.lease_id] = why
        decisions = self.state.decisions
        if decisions is not None:
            decisions.left(pool_id, req.tenant, req.lease_id, "rejected", now, reasons=why)

    def _reserved(self, ps: PoolState, bf: Backfill, req: PendingRequest, band: Any,
                  node_id: str, now: float) -> None:
        """A placed request: its wait reasons dropped, the terms that chose it recorded."""
        self.state.reasons.pop(req.lease_id, None)
        decisions = self.state.decisions
        if decisions is not None:
            decisions.left(ps.pool.pool_id, req.tenant, req.lease_id, "reserved", now,
                                node_id=node_id, terms=self._terms(ps, bf, req, band, now))

    def _wait(self, req: PendingRequest, reasons: dict[str, Any], unplaced: list[PendingRequest]) -> None:
        self.state.reasons[req.lease_id] = self.plan.reasons[req.lease_id] = reasons
        unplaced.append(req)

    def _capacity_wait(
        self,
        ps: PoolState,
        req: PendingRequest,
        lease: Lease | QueuedLease,
        fr: FilterResult,
        now: float,
    ) -> dict[str, Any]:
        """Why a request that fits no node now waits; may notice victims on its behalf (in
        the plan, so they land with the cycle's placements)."""
        if not ps.pool.config.preemption.enabled:
            return fr.wait_reasons([R.WAITING_FOR_CAPACITY]).to_dict()
        pending = self.preemption.pending(req.lease_id)
        if pending is None and self.planner.plans_left > 0:
            self.planner.plans_left -= 1
            plan = self.preemption.plan_for(ps, req, lease, fr, now)
            noticed = [] if plan is None else self.notice(ps, plan, now)
            if plan is not None and noticed:
                pending = PendingPreemption(plan.node_id, tuple(str(v.id) for v in noticed))
                self.state.preempting_for[req.lease_id] = pending
        if pending is None:
            return fr.wait_reasons([R.WAITING_FOR_CAPACITY]).to_dict()
        overdue = [v for v in pending.victims
                   if isinstance(vl := self.state.aggregates.get(UUID(v)), Lease)
                   and vl.preemption_overdue(now)]
        out = fr.wait_reasons([R.WAITING_FOR_PREEMPTION]).to_dict()
        out["preemption"] = {"node_id": pending.node_id, "victims": list(pending.victims),
                             "overdue": overdue}
        return out
