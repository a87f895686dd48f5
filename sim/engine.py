"""The policy simulator: the domain's leases and the scheduler's policy objects (FairQueue,
NodeTable, Backfill) driven through a workload by a virtual clock, with no sleeping.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from domain.lease import Lease
from domain.policy.backfill import (
    Backfill,
    LeaseEnd,
    band_of,
    lease_end_estimate,
    placed_end_estimate,
)
from domain.policy.fairness import DecayedUsage, FairQueue, PendingRequest, quota_check
from domain.policy.placement import FilterResult, NodeTable, Packing
from domain.poolconfig import PoolConfig
from domain.resources import ZERO, NodeId, PoolId, Resources, Shape, TenantId
from sim.workload import SimRequest, Workload

# the scheduler examines at most this many requests a cycle (workers.scheduler does the same)
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
    runs as the scheduler's does for a pool: pop in fair order, check quota, place with the
    table's best fit (beside any reservation when backfilling), else wait and go back in line.
    A placed lease is reserved and committed at once and released when its runtime is over.
    """

    def __init__(self, workload: Workload, policy: Policy, *,
                 config: PoolConfig | None = None, cycle_seconds: float = 60.0,
                 quotas: dict[str, Resources] | None = None,
                 on_cycle: Callable[[float, int], None] | None = None) -> None:
        if cycle_seconds <= 0:
            raise ValueError("cycle_seconds must be positive")
        self.workload = workload
        self.policy = policy
        self.config = config or PoolConfig(maximum_runtime_seconds=30 * 86_400)
        self.cycle_seconds = cycle_seconds
        self.quotas = dict(quotas or {})
        self.on_cycle = on_cycle
        self.clock = VirtualClock(0.0)
        self.table = NodeTable(initial_capacity=max(64, len(workload.nodes)))
        for node in workload.nodes:
            self.table.add_or_update_node(node.node_id, node.capabilities)
        self.totals = self.table.totals(ready_only=True)
        ranks = dict(self.config.priority_classes)
        self._ranks = ranks
        self.queue = FairQueue(
            # arrival order is the fair queue with nothing to be fair about: every share 0
            totals=self.totals if policy.order == "drf" else ZERO,
            weights={t.name: t.weight for t in workload.tenants},
            priority_ranks=ranks,
            aging_seconds_per_rank=float(self.config.aging_seconds_per_rank),
        )
        self.leases: dict[str, Lease] = {}
        self._outcome: dict[str, Outcome] = {}
        self._ends: list[tuple[float, int, str]] = []  # (time, seq, lease id)
        self._end_seq = 0
        self._seq = 0
        self._queued_shapes: Counter[Shape] = Counter()
        self._queued_bands: Counter[int] = Counter()
        # the tenants' decayed past usage, kept as the scheduler keeps it (workers.quotas)
        self.decay = (DecayedUsage(policy.half_life_seconds)
                      if policy.half_life_seconds > 0 and policy.order == "drf" else None)
        self.backfill = (Backfill(self.table, self._lease_end, depth=policy.depth)
                         if policy.backfill else None)
        self.result = SimResult(workload, policy, [], totals=self.totals)

    # ------------------------------------------------------------------ the run

    def run(self) -> SimResult:
        requests = self.workload.requests
        i = 0
        step = self.cycle_seconds
        while i < len(requests) or self._ends or len(self.queue):
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
                self._arrive(requests[i], now)
                i += 1
            self.cycle(now)
        self.result.outcomes = list(self._outcome.values())
        self.result.ended_at = self.clock.now
        return self.result

    def _arrive(self, req: SimRequest, now: float) -> None:
        lease = Lease.request(
            tenant_id=TenantId(req.tenant), pool_id=PoolId("sim"), idempotency_key=req.request_id,
            shape=req.shape, maximum_runtime_seconds=req.maximum_runtime_seconds,
            now=req.arrival, lease_seconds=req.maximum_runtime_seconds,
            priority_class=req.priority_class)
        lease.queue(req.arrival)
        lease.collect_events()  # nothing stores them: drop them as they come
        lid = str(lease.id)
        self.leases[lid] = lease
        self._outcome[lid] = Outcome(req)
        self._seq += 1
        self._push(PendingRequest(lid, req.tenant, req.priority_class, req.shape,
                                  lease.queued_at or req.arrival, self._seq))

    def _push(self, pending: PendingRequest) -> None:
        self.queue.push(pending)
        self._queued_shapes[pending.shape] += 1

    def _end(self, lid: str, now: float) -> None:
        lease = self.leases[lid]
        lease.release(now)
        lease.collect_events()
        self.table.free(lid)
        self.queue.released(lease.tenant_id, lease.resources)
        if self.decay is not None:
            self.decay.set_usage(lease.tenant_id, now, self.queue.usage(lease.tenant_id))
        self._outcome[lid].ended_at = now
        del self.leases[lid]  # ended leases are only needed as outcomes

    def _lease_end(self, lid: str) -> LeaseEnd | None:
        lease = self.leases.get(lid)
        if lease is None:
            return None
        return lease.resources, lease_end_estimate(lease)

    # ------------------------------------------------------------------ one cycle

    def cycle(self, now: float) -> int:
        """One scheduling cycle at `now`; returns how many requests were placed."""
        cfg = self.config
        queue = self.queue
        packing: Packing = cfg.packing  # type: ignore[assignment]
        if self.decay is not None:  # as workers.quotas.apply_history, before any pop
            for tenant in self.decay.tenants():
                queue.set_history(tenant, self.decay.share(tenant, now, self.totals))
        bf = self.backfill
        if bf is not None:
            bf.begin(now, queued=self.queue.__contains__)
        placed = 0
        examined = 0
        unplaced: list[PendingRequest] = []
        reserved: list[Lease] = []
        # capacity only shrinks within a cycle: a shape that fit nowhere stays unplaceable, so
        # later requests of that shape are not filtered again (an exact shortcut)
        failed: dict[Shape, FilterResult] = {}
        # a shape refused beside a reservation until a given end is refused for any later end
        held_from: dict[Shape, float] = {}
        bands_tried: set[int] = set()
        while examined < MAX_EXAMINED_PER_CYCLE:
            if self._nothing_more_fits(failed, bands_tried, bf):
                break
            req = queue.pop(now)
            if req is None:
                break
            examined += 1
            self._queued_shapes[req.shape] -= 1
            lease = self.leases[req.lease_id]
            res = req.shape.resources
            quota = self.quotas.get(req.tenant)
            if quota is not None and quota_check(queue.usage(req.tenant), res, quota):
                unplaced.append(req)
                continue
            end_at = placed_end_estimate(now, cfg.commit_timeout_seconds,
                                         lease.maximum_runtime_seconds)
            head = bf is not None and bf.reservation_of(req.lease_id) is not None
            node_id: str | None = None
            fr = failed.get(req.shape)
            held = req.shape in held_from and end_at >= held_from[req.shape] and not head
            if fr is None and not held:
                if bf is None:
                    node_id, fr = self.table.place_fast(req.shape, packing=packing)
                else:
                    # its band and the queue, as the scheduler passes them: a head offered
                    # later never holds it back
                    node_id, fr, held = bf.place(
                        req.shape, end_at, packing=packing, allowed_trust_levels=None,
                        lease_id=req.lease_id,
                        band=band_of(req.priority_class, req.enqueued_at, now, self._ranks,
                                     cfg.aging_seconds_per_rank),
                        offered_later=queue.__contains__)
                    if held:  # it fits now, only not beside a reservation
                        if not head:
                            held_from[req.shape] = min(end_at, held_from.get(req.shape, end_at))
                        self.result.held_back += 1
                        fr = None
                    elif node_id is not None:
                        fr = None
                if node_id is None and fr is not None:
                    if fr.never_satisfiable:
                        continue  # dropped: nothing in the pool could ever take it
                    failed[req.shape] = fr
            if node_id is None:
                if bf is not None and fr is not None:
                    band = band_of(req.priority_class, req.enqueued_at, now, self._ranks,
                                   cfg.aging_seconds_per_rank)
                    bands_tried.add(band)
                    if bf.blocked(req.lease_id, req.shape, band) is not None and not head:
                        self.result.reservations_made += 1
                unplaced.append(req)
                continue
            if bf is not None:
                bf.placed(req.lease_id)
            # reserved now and committed once the cycle is over, as a client commits after the
            # scheduler's batch: within the cycle its end estimate is a reservation's
            lease.reserve(now, node_id=NodeId(node_id),
                          commit_timeout_seconds=cfg.commit_timeout_seconds, hold_microcredits=0)
            reserved.append(lease)
            self.table.allocate(node_id, req.lease_id, res, tenant=req.tenant)
            queue.placed(req)
            if self.decay is not None:
                self.decay.set_usage(req.tenant, now, queue.usage(req.tenant))
            out = self._outcome[req.lease_id]
            out.started_at, out.node_id = now, node_id
            self.result.placements.append(out.request.request_id)
            self._end_seq += 1
            heapq.heappush(self._ends, (now + out.request.runtime_seconds, self._end_seq,
                                        req.lease_id))
            placed += 1
        for req in unplaced:
            self._push(req)
        for lease in reserved:
            lease.commit(now)
            lease.collect_events()
        self.result.cycles += 1
        if self.on_cycle is not None:
            self.on_cycle(now, placed)
        return placed

    def _nothing_more_fits(self, failed: dict[Shape, FilterResult], bands_tried: set[int],
                           bf: Backfill | None) -> bool:
        """Every shape still queued fit nowhere this cycle (and, when backfilling, the band
        of the first one to fail has been offered its reservation): popping on is wasted."""
        if not failed:
            return False
        for shape, count in self._queued_shapes.items():
            if count > 0 and shape not in failed:
                return False
        if bf is None:
            return True
        # with aging off, the bands queued are the class ranks queued
        if self.config.aging_seconds_per_rank > 0:
            return False
        # one band: done once it holds all the heads it may (each blocked request popped
        # after that only waits behind them)
        return len(self._ranks) == 1 and (len(bf.reservations) >= bf.depth
                                          or (bf.depth == 1 and bool(bands_tried)))
