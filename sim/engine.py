"""The policy simulator: a workload's requests placed by the live scheduler's own planner
(workers.scheduler: `Planner.plan` over a `SchedulerFold` built in memory from the simulated
events, no log and no bus), driven by a virtual clock, with no sleeping.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal
from uuid import UUID

from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.policy import reasons as R
from domain.policy.backfill import Backfill
from domain.pool import Pool
from domain.poolconfig import PoolConfig
from domain.quota import TenantQuota, limits
from domain.resources import ZERO, NodeId, PoolId, Resources, TenantId
from sim.workload import SimRequest, Workload
from workers.scheduler.folding import SchedulerFold
from workers.scheduler.planner import Planner
from workers.scheduler.state import PoolState

# the scheduler examines at most this many requests a cycle (its Planner's default)
MAX_EXAMINED_PER_CYCLE = 5000


class VirtualClock:
    """Simulated time: reads like `time.time` (call it), moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance_to(self, at: float) -> None:
        if at < self.now:
            raise ValueError(f"a virtual clock never goes back ({at} < {self.now})")
        self.now = float(at)


@dataclass(frozen=True)
class Policy:
    """A scheduling policy variant: how the queue is ordered, and whether to backfill."""

    name: str
    order: Literal["fifo", "drf"] = "drf"
    backfill: bool = False
    depth: int = 1  # backfill reservations per priority band (1: EASY)
    # DRF counts past usage decayed with this half-life besides current usage; 0: current only
    half_life_seconds: float = 0.0

    def describe(self) -> str:
        what = {"fifo": "arrival order", "drf": "weighted DRF (the scheduler's FairQueue)"}
        return (what[self.order]
                + (f" + usage decayed over {self.half_life_seconds / 86_400:g} d"
                   if self.half_life_seconds else "")
                + (" + EASY backfill" if self.backfill else ""))


WEEK = 7 * 86_400.0
FIFO = Policy("fifo", order="fifo")
DRF = Policy("drf")
DRF_DECAY = Policy("drf+decay", half_life_seconds=WEEK)
DRF_BACKFILL = Policy("drf+backfill", backfill=True)
DRF_DECAY_BACKFILL = Policy("drf+decay+backfill", backfill=True, half_life_seconds=WEEK)


@dataclass
class Outcome:
    """What became of one request."""

    request: SimRequest
    started_at: float | None = None
    ended_at: float | None = None
    node_id: str | None = None

    @property
    def wait_seconds(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.request.arrival


@dataclass
class SimResult:
    workload: Workload
    policy: Policy
    outcomes: list[Outcome]
    cycles: int = 0
    ended_at: float = 0.0
    totals: Resources = ZERO
    reservations_made: int = 0
    held_back: int = 0  # placements refused because they would have delayed a reservation
    extras: dict[str, float] = field(default_factory=dict)
    placements: list[str] = field(default_factory=list)  # request ids, in placement order


class Simulator:
    """Replays `workload` through `policy` on a virtual clock.

    Every `cycle_seconds` of simulated time in which something arrived or ended, one cycle
    runs as the live scheduler's does for a pool: `Planner.plan` over the scheduler's own fold
    state (`SchedulerFold`), fed the requests', reservations' and ends' events in memory. A
    placed lease is reserved, committed once the cycle is over (as a client commits after the
    scheduler's batch) and released when its runtime is over.
    """

    POOL = "sim"

    def __init__(self, workload: Workload, policy: Policy, *,
                 config: PoolConfig | None = None, cycle_seconds: float = 60.0,
                 quotas: dict[str, Resources] | None = None,
                 on_cycle: Callable[[float, int], None] | None = None) -> None:
        if cycle_seconds <= 0:
            raise ValueError("cycle_seconds must be positive")
        self.workload = workload
        self.policy = policy
        # the policy's half-life is the pool's setting the scheduler reads (0: current usage);
        # preemption is not simulated (docs/audit.md): no victim is noticed
        decay = policy.half_life_seconds if policy.order == "drf" else 0.0
        cfg = config or PoolConfig(maximum_runtime_seconds=30 * 86_400)
        self.config = replace(cfg, fair_share_half_life_seconds=int(decay),
                              preemption=replace(cfg.preemption, enabled=False))
        self.cycle_seconds = cycle_seconds
        self.quotas = dict(quotas or {})
        self.on_cycle = on_cycle
        self.clock = VirtualClock(0.0)
        self.fold = SchedulerFold(clock=self.clock)
        # no start estimates, and a pass stops once nothing more fits: both only explain
        # waits (`why`), which no one asks here
        self.planner = Planner(backfill=policy.backfill,
                               max_examined_per_cycle=MAX_EXAMINED_PER_CYCLE,
                               estimate_starts=False, stop_when_nothing_fits=True)
        self.ps = self._build_pool()
        self.table = self.ps.table
        self.totals = self.table.totals(ready_only=True)
        self._outcome: dict[str, Outcome] = {}
        self._ends: list[tuple[float, int, str]] = []  # (time, seq, lease id)
        self._end_seq = 0
        self._heads: set[str] = set()  # blocked heads that were given a reservation
        self.result = SimResult(workload, policy, [], totals=self.totals)

    def _build_pool(self) -> PoolState:
        """The pool, its nodes and its tenants' weights and quotas in the fold, as catch-up
        leaves them after the log's pool, node and tenant events."""
        fold, pool_id = self.fold, PoolId(self.POOL)
        aggregates: list[Pool | Node] = [Pool.create(pool_id=pool_id, now=0.0,
                                                     config=self.config)]
        aggregates += [Node.register(node_id=NodeId(n.node_id), pool_id=pool_id,
                                     capabilities=n.capabilities, now=0.0)
                       for n in self.workload.nodes]
        for agg in aggregates:
            for event in agg.collect_events():
                fold.apply(event)
        ps = fold.pools[self.POOL]
        assert ps.queue is not None
        # weights as given (the fair queue compares them; a TenantPolicy's are integers)
        for tenant in self.workload.tenants:
            ps.weights[tenant.name] = tenant.weight
            ps.queue.set_weight(tenant.name, tenant.weight)
        for tenant_id, quota in self.quotas.items():
            ps.book.set_tenant(TenantQuota(tenant_id, nominal=limits(quota)))
        ps.refresh_totals()
        if self.policy.order == "fifo":
            # arrival order is the fair queue with nothing to be fair about: every share 0
            ps.queue.set_totals(ZERO)
        if self.policy.backfill:
            ps.backfill = Backfill(ps.table, fold.lease_end, depth=self.policy.depth)
        return ps

    # ------------------------------------------------------------------ the run

    def run(self) -> SimResult:
        requests = self.workload.requests
        i = 0
        step = self.cycle_seconds
        queue = self.ps.queue
        assert queue is not None
        while i < len(requests) or self._ends or len(queue):
            upcoming = []
            if i < len(requests):
                upcoming.append(requests[i].arrival)
            if self._ends:
                upcoming.append(self._ends[0][0])
            if not upcoming:
                break  # only requests that can never be placed are left
            # the scheduler wakes at the first cycle boundary at or after the next event
            at = max(self.clock.now, -(-min(upcoming) // step) * step)
            self.clock.advance_to(at)
            now = self.clock()
            while self._ends and self._ends[0][0] <= now:
                _, _, lid = heapq.heappop(self._ends)
                self._end(lid, now)
            while i < len(requests) and requests[i].arrival <= now:
                self._arrive(requests[i])
                i += 1
            self.cycle(now)
        self.result.outcomes = list(self._outcome.values())
        self.result.ended_at = self.clock.now
        return self.result

    def _arrive(self, req: SimRequest) -> None:
        lease = Lease.request(
            tenant_id=TenantId(req.tenant), pool_id=PoolId(self.POOL),
            idempotency_key=req.request_id, shape=req.shape,
            maximum_runtime_seconds=req.maximum_runtime_seconds, now=req.arrival,
            lease_seconds=req.maximum_runtime_seconds, priority_class=req.priority_class)
        lease.queue(req.arrival)
        self._outcome[str(lease.id)] = Outcome(req)
        for event in lease.collect_events():  # the fold holds it compactly, queued
            self.fold.apply(event)

    def _end(self, lid: str, now: float) -> None:
        lease = self.fold.aggregates.get(UUID(lid))
        assert isinstance(lease, Lease)
        lease.release(now)
        lease.collect_events()
        self.table.free(lid)  # the node's release, as its event would fold
        self.fold.index(lease)  # usage returned (and its decayed record), the lease forgotten
        self._outcome[lid].ended_at = now

    # ------------------------------------------------------------------ one cycle

    def cycle(self, now: float) -> int:
        """One scheduling cycle at `now`; returns how many requests were placed."""
        self.planner.begin_cycle()
        reserved: list[Lease] = []
        for plan in self.planner.plan(self.fold, self.ps, now):
            # saving is the batch writer's: here nothing stores the events
            for agg in plan.aggregates:
                agg.collect_events()
            self.result.held_back += sum(
                1 for why in plan.reasons.values()
                if R.WAITING_FOR_RESERVATION in why.get("tenant", ()))
            for lease in plan.reserved:
                lid = str(lease.id)
                out = self._outcome[lid]
                out.started_at, out.node_id = now, str(lease.node_id)
                self.result.placements.append(out.request.request_id)
                self._end_seq += 1
                heapq.heappush(self._ends, (now + out.request.runtime_seconds,
                                            self._end_seq, lid))
                reserved.append(lease)
        bf = self.ps.backfill
        if bf is not None and self.policy.backfill:
            new = {r.lease_id for r in bf.reservations.values()} - self._heads  # a blocked head given its reservation
            self.result.reservations_made += len(new)
            self._heads |= new
        for lease in reserved:
            if lease.state is LeaseState.RESERVED:
                lease.commit(now)
                lease.collect_events()
                self.fold.index(lease)
        self.result.cycles += 1
        if self.on_cycle is not None:
            self.on_cycle(now, len(reserved))
        return len(reserved)
