"""The scheduler: folds the log into memory and places queued leases in cycles, one atomic
batch per cycle (docs/architecture.md#the-scheduler).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import gc
import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError

from bus import observability
from bus.transcoder import EventDecoder
from control.pending import LeaseMemory, QueuedLease
from control.quotas import (
    apply_history,
    may_be_victim,
    quota_wait,
    remember_usage,
    restart_job,
)
from control.reservations import Windows
from control.wake import IdleWait, Signal
from domain.account import Account
from domain.cohort import Cohort
from domain.errors import DomainError
from domain.fold import mutate
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.policy import reasons as R
from domain.policy.backfill import (
    Backfill,
    LeaseEnd,
    band_of,
    lease_end_estimate,
    placed_end_estimate,
)
from domain.policy.fairness import (
    DecayedUsage,
    FairQueue,
    PendingRequest,
    weighted_dominant_share,
)
from domain.policy.placement import FilterResult, NodeTable
from domain.policy.preemption import (
    PREEMPTED,
    NodeCandidate,
    PreemptionPlan,
    RunningLease,
    choose_victims,
)
from domain.pool import Pool, TenantPolicy
from domain.quota import QuotaBook
from domain.reservation import CapacityReservation
from domain.resources import TRUST_LEVELS, ZERO, LeaseId, NodeId, Resources, Shape

log = logging.getLogger(__name__)

Placed = tuple[LeaseId, Resources, tuple[str, ...]]  # a placement on a node: lease, amount, devices

# States of a victim on its way out that still hold its node's capacity.
_LEAVING = frozenset(
    {LeaseState.PREEMPTING, LeaseState.STOPPING, LeaseState.EXPIRED, LeaseState.RECONCILING}
)
# a batch goes out once it holds this many messages (lease + node [+ account] per placement,
# one per rejection or noticed victim): under JetStream's 1000-message atomic batch limit with
# room for the step that crossed it
MAX_MESSAGES_PER_BATCH = 900
NOTIFICATION_PAGE = 1000
LONG_LIVED_FOLD = 20_000  # a catch-up of at least this many events was a replay (see catch_up)
OTHERS_DEADLINE_RETRY_SECONDS = 1.0  # a due deadline of a pool led elsewhere, looked at again
ENDED_REMEMBERED = 10_000  # ended leases whose last state `why` still answers
# the cyclic collector's thresholds in a process that schedules: a placement makes a few
# dozen short-lived containers (events, their state dicts, stored events), so with CPython's
# default of 700 a young collection ran every ~20 placements and promoted survivors that the
# older generations then walked again and again (docs/performance.md)
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc() -> None:
    """Raise the collector's thresholds to GC_THRESHOLDS (never lower them): for processes
    that run the scheduler. Reference counting still frees everything that is not a cycle."""
    current = gc.get_threshold()
    if current[0] < GC_THRESHOLDS[0]:
        gc.set_threshold(*GC_THRESHOLDS)


@dataclass
class PoolState:
    """One pool as the scheduler holds it: nodes in arrays, the fair queue, tenant policies."""

    pool: Pool
    table: NodeTable = field(default_factory=NodeTable)
    queue: FairQueue | None = None
    weights: dict[str, float] = field(default_factory=dict)
    book: QuotaBook = field(default_factory=QuotaBook)  # nominal quotas and cohorts
    protected: set[str] = field(default_factory=set)  # tenants that are not preemptible
    decay: DecayedUsage = field(default_factory=DecayedUsage)  # past usage, for fair share
    # node id → (state, allocatable) as the DRF denominator last counted it; the denominator
    # (allocatable of the ready nodes) is summed again before the next placement only when a
    # node came, left readiness or changed size: summing it per node event made a replay of N
    # node registrations O(N²)
    counted: dict[str, tuple[str, Resources]] = field(default_factory=dict)
    totals_stale: bool = False
    backfill: Backfill | None = None  # its blocked heads' reservations, kept between cycles

    def refresh_totals(self) -> None:
        """The fair queue's denominator brought up to date, if a node changed it."""
        if self.totals_stale and self.queue is not None:
            self.totals_stale = False
            self.queue.set_totals(self.table.totals(ready_only=True))

    def rebuild_queue(self) -> None:
        old = self.queue
        cfg = self.pool.config
        self.totals_stale = False
        self.decay.half_life_seconds = float(cfg.fair_share_half_life_seconds)
        self.queue = FairQueue(
            totals=self.table.totals(ready_only=True),
            weights=self.weights,
            priority_ranks=dict(cfg.priority_classes),
            aging_seconds_per_rank=float(cfg.aging_seconds_per_rank),
        )
        if old is not None:
            for tenant in list(old._usage):
                self.queue.set_usage(tenant, old.usage(tenant))
            self.queue.extend(old._requests.values())


@dataclass
class CycleReport:
    placed: int = 0
    rejected: int = 0
    waiting: int = 0
    voided: int = 0
    expired: int = 0
    conflicts: int = 0
    batches: int = 0
    preempted: int = 0  # victims noticed this cycle
    overdue: int = 0  # victims whose grace ran out unconfirmed (still holding capacity)


@dataclass(frozen=True)
class _InFlight:
    """A cycle's batch sent and not yet acknowledged, with what to undo if it is refused."""

    pending: Any  # control.application.PendingSave
    aggregates: list[Aggregate]
    placing: list[tuple[Lease, int]]


@dataclass(frozen=True)
class PendingPreemption:
    """A waiting request's claim on a node whose victims were noticed on its behalf."""

    node_id: str
    victims: tuple[str, ...]


class Scheduler:
    """Follows the log through `app`, decides placements, saves them through `app`."""

    def __init__(self, app: Any, *, clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.clock = clock
        self.position = 0
        # queued leases compactly; the rest whole, until an ended lease is settled
        self.aggregates = LeaseMemory()
        # the last ended leases, kept only to answer `why` about them
        self._ended: collections.OrderedDict[str, tuple[str, dict[str, Any]]] = (
            collections.OrderedDict())
        # which pools this scheduler places and sweeps (control.pool_leaders: those it leads)
        self.leads: Callable[[str], bool] = lambda _pool_id: True
        self.pools: dict[str, PoolState] = {}
        self.reasons: dict[str, dict[str, Any]] = {}
        self._seq = 0
        # (due_at, lease_id) for reservations and running leases: the deadline sweep
        self._deadlines: list[tuple[float, str]] = []
        self._usage: dict[str, tuple[str, Resources]] = {}  # lease -> (tenant, resources)
        # requester lease -> the preemption started for it; one at a time per request
        self._preempting_for: dict[str, PendingPreemption] = {}
        self.max_examined_per_cycle = 5000
        # EASY backfill (domain.policy.backfill): off, a later request may take capacity a
        # blocked wide one is gathering; waiting requests get a position and a start estimate
        # either way
        self.backfill = True
        # advance reservations and maintenance windows, kept out of others' placements
        self.windows = Windows()
        # planning a preemption walks every busy node's leases: bound that work per cycle
        self.max_preemption_plans_per_cycle = 32
        self._plans_left = 0
        self._lock = threading.RLock()
        # placements of the batch being built: (lease, reserved at, ns) for their `place` spans
        self._placing: list[tuple[Lease, int]] = []
        # the batch whose acknowledgement is awaited while the next one is planned
        self._inflight: _InFlight | None = None
        # (first, last) notification ids of our acknowledged batches not yet passed by
        # catch_up, in log order: catch_up steps over them instead of reading them back
        self._own: collections.deque[tuple[int, int]] = collections.deque()
        # the mapper's to_domain_event, without its walk over the whole decoded state where
        # the stored event holds just one transcoded value (its timestamp); anything else
        # goes through the mapper
        self._decode = EventDecoder(app.mapper)
        self._read_ahead: concurrent.futures.ThreadPoolExecutor | None = None
        # bus.jetstream's read-ahead pages, told to remember every subject they pass (as
        # direct gets do), so that writing to an aggregate only read needs no look-up first
        self._prefetch = getattr(app.recorder, "prefetch", None)
        if self._prefetch is not None:
            app.recorder.remember_subjects_read = True
        # a read that does not finish fails the cycle (the run loop logs it and goes on)
        self._read_timeout = float(getattr(app.recorder, "timeout", 10.0)) + 20.0
        # the credit holds of the batch being built, per tenant, recorded when it closes:
        # (transfer id, lease, amount) each, and their sum
        self._holds: dict[str, list[tuple[str, LeaseId, int]]] = {}
        self._held: dict[str, int] = {}
        self.pages_read_ahead = 0  # pages catch-up took from a read ahead
        self.pages_read_ahead_unused = 0  # reads ahead it could not use (asked for the wrong range)

    # -- folding the log --------------------------------------------------------------------

    def catch_up(self) -> int:
        """Apply every event after `position`; returns how many were read. The ranges our own
        acknowledged batches occupy are stepped over unread: their events are in memory."""
        n = self._catch_up()
        if n >= LONG_LIVED_FOLD:
            # a replay (start-up, or a long absence) built state that lives as long as the
            # scheduler: move it out of the cyclic collector's sight, or every full collection
            # re-walks millions of objects (docs/performance.md).
            # Freed objects are still freed by reference counting; only reference cycles
            # that exist now and die later would stay (the fold's aggregates hold none)
            gc.freeze()
        return n

    def _catch_up(self) -> int:
        n = 0
        own = self._own
        decode = self._decode
        # the next page, asked for while this one is folded: the server and the bus thread
        # read it in the meantime (a catch-up spent a third of its time waiting for reads)
        ahead: tuple[int, int, concurrent.futures.Future[Any]] | None = None
        try:
            while True:
                while own and own[0][0] <= self.position + 1:
                    self.position = max(self.position, own.popleft()[1])
                start, limit = self._next_read(self.position)
                if ahead is not None and ahead[:2] == (start, limit):
                    page = ahead[2].result(self._read_timeout)
                    self.pages_read_ahead += 1
                else:
                    if ahead is not None:
                        concurrent.futures.wait([ahead[2]], self._read_timeout)
                        self.pages_read_ahead_unused += 1
                    page = self._read(start, limit).result(self._read_timeout)
                ahead = None
                if not page:
                    return n
                # a full page may have more behind it; so may any page of a read-ahead
                # (`prefetch` returns what is stored now, perhaps less): read until one is empty
                more = len(page) == limit or self._prefetch is not None
                if more:
                    at, size = self._next_read(page[-1].id)
                    ahead = (at, size, self._read(at, size))
                version_of = self.aggregates.version_of
                for notification in page:
                    known = version_of(notification.originator_id)
                    # our own writes come back through the log: skip them before decoding
                    if known is None or notification.originator_version > known:
                        self.apply(decode(notification))
                    self.position = notification.id
                n += len(page)
                if not more:
                    return n
        finally:
            if ahead is not None:  # left by a fold that raised: let it finish, unread
                concurrent.futures.wait([ahead[2]], self._read_timeout)

    def _next_read(self, position: int) -> tuple[int, int]:
        """(start, limit) of the read after `position`: past our own acknowledged batches
        that begin there, and no further than the next one (its events are in memory)."""
        for first, last in self._own:
            if first > position + 1:
                return position + 1, min(NOTIFICATION_PAGE, first - position - 1)
            position = max(position, last)
        return position + 1, NOTIFICATION_PAGE

    def close(self) -> None:
        """Stop the read-ahead thread, if any (not waiting for a cycle in progress: that ends
        on its own, its reads failing once the bus is closed)."""
        pool, self._read_ahead = self._read_ahead, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, start: int, limit: int) -> concurrent.futures.Future[Any]:
        """The events [start, start + limit) as they are stored now, read in the background:
        through the recorder's read-ahead (a pull consumer: a third of a direct get's cost to
        the server and far less to this process) when it has one, else `select_notifications`
        on a thread of ours."""
        if self._prefetch is not None:
            return self._prefetch(start, limit, start + limit - 1)  # type: ignore[no-any-return]
        return self._reader().submit(
            self.app.recorder.select_notifications, start=start, limit=limit)

    def _reader(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._read_ahead is None:
            self._read_ahead = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="scheduler-read-ahead")
        return self._read_ahead

    def apply(self, event: Any) -> None:
        compact = self.aggregates.absorb(event)
        if compact is not False:  # a request, or its queueing: held compactly
            if isinstance(compact, QueuedLease):
                self._queue(compact)
            return
        agg = self.aggregates.get(event.originator_id)
        if agg is None:
            if event.originator_version != 1:
                return  # history we cannot fold (never happens with a log read from 1)
            agg = event.mutate(None)
        elif event.originator_version == agg.version + 1:
            agg = mutate(event, agg)  # the library's fold, its lean path where equivalent
        else:
            return  # our own write coming back, already applied in memory
        assert agg is not None
        self.aggregates[agg.id] = agg
        self._index(agg)

    def _index(self, agg: Aggregate) -> None:
        if isinstance(agg, Pool):
            ps = self.pools.get(agg.pool_id)
            if ps is None:
                ps = self.pools[agg.pool_id] = PoolState(pool=agg)
            ps.pool = agg
            ps.rebuild_queue()
        elif isinstance(agg, TenantPolicy):
            ps = self.pools.get(agg.pool_id)
            if ps is not None:
                ps.weights[agg.tenant_id] = float(agg.weight)
                ps.book.set_tenant(agg.limits)
                (ps.protected.discard if agg.preemptible else ps.protected.add)(agg.tenant_id)
                assert ps.queue is not None
                ps.queue.set_weight(agg.tenant_id, float(agg.weight))
        elif isinstance(agg, Cohort):
            ps = self.pools.get(agg.pool_id)
            if ps is not None:
                ps.book.set_cohort(agg.quota)
        elif isinstance(agg, CapacityReservation):
            self.windows.index(agg)
        elif isinstance(agg, Node):
            self._index_node(agg)
        elif isinstance(agg, Lease):
            self._index_lease(agg)

    def _index_node(self, node: Node) -> None:
        ps = self.pools.get(node.pool_id)
        if ps is None:
            return
        state = str(node.state)
        seen = (state, node.capabilities.allocatable)
        if ps.counted.get(node.node_id) != seen:
            ps.counted[node.node_id] = seen
            ps.totals_stale = True
        ps.table.add_or_update_node(node.node_id, node.capabilities, state)
        ps.table.set_state(node.node_id, state)
        have = set(ps.table.leases_on(node.node_id))
        want = node.allocations
        for lid in have - set(want):
            ps.table.free(lid)
        for lid in set(want) - have:
            if ps.table.node_of(lid) is not None:
                # the log puts it here now (a node re-read after a refused batch can be newer
                # than the rest of our memory): drop the older whereabouts we hold for it
                ps.table.free(lid)
            lease = self.aggregates.get(UUID(lid))
            tenant = lease.tenant_id if isinstance(lease, Lease) else None
            ps.table.allocate(node.node_id, lid, want[lid], tenant=tenant)

    def _index_lease(self, lease: Lease) -> None:
        ps = self.pools.get(lease.pool_id)
        if ps is None or ps.queue is None:
            if lease.is_terminal:
                self._forget(lease)
            return
        lid = str(lease.id)
        self._track(ps, lease)
        if lease.state is LeaseState.QUEUED:
            self._queue(lease)
            return
        if lid in ps.queue:
            ps.queue.remove(lid)
        if lease.is_terminal:
            self._forget(lease)
            return
        self.reasons.pop(lid, None)
        self._preempting_for.pop(lid, None)
        due = lease.next_due_at()
        if due is not None:
            heapq.heappush(self._deadlines, (due, lid))

    def _queue(self, lease: Lease | QueuedLease) -> None:
        """Put a queued lease in its pool's fair queue (once)."""
        if isinstance(lease, Lease):
            self.aggregates.compact(lease)  # e.g. re-read after a refused save
        ps = self.pools.get(lease.pool_id)
        lid = str(lease.id)
        if ps is None or ps.queue is None or lid in ps.queue:
            return
        self._seq += 1
        ps.queue.push(PendingRequest(
            lease_id=lid,
            tenant=lease.tenant_id,
            priority_class=lease.priority_class,
            shape=lease.requested_shape,
            enqueued_at=lease.queued_at or lease.requested_at,
            seq=self._seq,
        ))

    def _forget(self, lease: Lease) -> None:
        """An ended lease leaves memory (a preempted one stays: it may be requeued); its
        state and reasons are kept a while for `why`."""
        if lease.state is LeaseState.PREEMPTED:
            return
        lid = str(lease.id)
        reasons = self.reasons.pop(lid, None)
        if reasons is None and lease.state is LeaseState.REJECTED:
            reasons = {"rejection_code": lease.rejection_code}
        self._ended[lid] = (lease.tenant_id, {"lease_id": lid, "state": str(lease.state),
                                              "reasons": reasons or {}})
        if len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        self._preempting_for.pop(lid, None)
        self.aggregates.pop(lease.id, None)

    def _track(self, ps: PoolState, lease: Lease) -> None:
        """Keep each tenant's usage (the DRF numerator) = its capacity-holding leases."""
        self.windows.track(lease)
        lid = str(lease.id)
        tracked = self._usage.get(lid)
        holds = lease.holds_capacity
        assert ps.queue is not None
        if holds and tracked is None:
            self._usage[lid] = (lease.tenant_id, lease.resources)
            ps.queue.add_usage(lease.tenant_id, lease.resources)
        elif not holds and tracked is not None:
            del self._usage[lid]
            ps.queue.released(tracked[0], tracked[1])
        else:
            return
        if ps.decay.half_life_seconds:
            remember_usage(ps, lease)

    # -- deciding ---------------------------------------------------------------------------

    def cycle(self) -> CycleReport:
        """Catch up, sweep deadlines, place what fits; one atomic batch per ≤900 messages."""
        with self._lock:
            self.catch_up()
            report = CycleReport()
            now = self.clock()
            self._plans_left = self.max_preemption_plans_per_cycle
            self._sweep(now, report)
            for ps in self.pools.values():
                if self.leads(ps.pool.pool_id):
                    self._place_pool(ps, now, report)
            observability.record_cycle(report)
            return report

    def _save(self, aggs: list[Aggregate], report: CycleReport) -> bool:
        unique = list({a.id: a for a in aggs}.values())
        if not unique:
            return True
        try:
            recordings = self.app.save(*unique)
            report.batches += 1
            self._saved([r.notification.id for r in recordings or ()])
            self._settled(unique)
            return True
        except IntegrityError:
            # someone else wrote one of these first: forget our in-memory view of them and
            # re-read the log; the requests are still queued and the next cycle retries
            report.conflicts += 1
            for a in unique:
                self.aggregates.pop(a.id, None)
            self._reload(unique)
            return False

    def _reload(self, aggs: list[Aggregate]) -> None:
        for a in aggs:
            fresh = self.app.repository.get(a.id)
            self.aggregates[fresh.id] = fresh
        for a in aggs:
            self._index(self.aggregates[a.id])

    def _sweep(self, now: float, report: CycleReport) -> None:
        """Void uncommitted reservations and expire silent leases whose time has come."""
        batch: list[Aggregate] = []
        others: list[tuple[float, str]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _due, lid = heapq.heappop(self._deadlines)
            lease = self.aggregates.get(UUID(lid))
            if not isinstance(lease, Lease):
                continue
            if not self.leads(lease.pool_id):
                # another scheduler's pool: looked at again later, in case this one takes it
                others.append((now + OTHERS_DEADLINE_RETRY_SECONDS, lid))
                continue
            reason = lease.expiry_due(now)
            if reason is None:
                self._note_overdue(lease, now, report)
                continue
            try:
                if lease.state is LeaseState.RESERVED:
                    lease.void_reservation(now)
                    batch += self._return_capacity(lease, now, charge=False)
                    report.voided += 1
                else:
                    # never recycled silently: capacity stays held until the agent confirms
                    lease.expire(now, reason)
                    lease.begin_reconciliation(now)
                    report.expired += 1
            except DomainError:
                continue
            batch.append(lease)
            if len(batch) >= 900:
                self._save(batch, report)
                batch = []
        for item in others:
            heapq.heappush(self._deadlines, item)
        self._save(batch, report)

    def _note_overdue(self, lease: Lease, now: float, report: CycleReport) -> None:
        """A victim past its grace without a stop confirmation keeps its capacity: no expiry
        reason covers it (only its lease deadline or lost heartbeats do, and the sweep applies
        those), so the requester keeps waiting and `why` names the overdue victim."""
        if lease.preemption_overdue(now):
            report.overdue += 1
            log.warning("lease %s is past its preemption grace and not confirmed stopped",
                        lease.id)

    def _return_capacity(self, lease: Lease, now: float, *, charge: bool) -> list[Aggregate]:
        out: list[Aggregate] = []
        if lease.node_id is not None:
            node = self.aggregates.get(Node.create_id(lease.node_id))
            if isinstance(node, Node) and node.free(LeaseId(str(lease.id)), now):
                out.append(node)
        acc = self.aggregates.get(Account.create_id(lease.tenant_id))
        lid = LeaseId(str(lease.id))
        if isinstance(acc, Account) and acc.has_hold(lid):
            acc.release_hold(f"void-{lease.id}-{lease.epoch}", lid, now)
            out.append(acc)
        ps = self.pools.get(lease.pool_id)
        if ps is not None:
            ps.table.free(str(lease.id))
            self._track(ps, lease)
        return out

    def _place_pool(self, ps: PoolState, now: float, report: CycleReport) -> None:
        queue = ps.queue
        if queue is None or not len(queue):
            return
        ps.refresh_totals()
        if ps.decay.half_life_seconds:
            apply_history(ps, now)
        self._holds.clear()  # as `allocs` below: nothing of a batch that never closed
        self._held.clear()
        pool = ps.pool
        cfg = pool.config
        batch: list[Aggregate] = []
        # node id → the placements on it not yet recorded: one node event per node per batch
        # (`Node.allocate_many`), written when the batch closes, not one event per placement
        allocs: dict[str, list[tuple[LeaseId, Resources, tuple[str, ...]]]] = {}
        unplaced: list[PendingRequest] = []
        examined = 0
        # (isolation, tenant) → the node trust levels the pool's image policy allows it
        # (None: any), asked once per cycle rather than at every placement
        trust_of: dict[tuple[str, str], tuple[str, ...] | None] = {}
        if ps.backfill is None:
            ps.backfill = Backfill(ps.table, self._lease_end)
        bf = ps.backfill
        # windows first: the heads' reservations, made again by `begin`, stay out of them
        self.windows.apply(pool.pool_id, bf, now)
        bf.begin(now, queued=queue.__contains__)
        # windows are kept through backfill's admission, so it is used while any is in force
        guarded = self.backfill or self.windows.in_force(pool.pool_id)
        starts: dict[str, float | None] = {}  # waiting request → estimated start
        # one pop at a time: each placement changes its tenant's share before the next pick
        while examined < self.max_examined_per_cycle and (req := queue.pop(now)) is not None:
            examined += 1
            # a compact QueuedLease until it is rejected or reserved (`_whole`)
            lease = self.aggregates.peek(UUID(req.lease_id))
            if (not isinstance(lease, (Lease, QueuedLease))
                    or lease.state is not LeaseState.QUEUED):
                continue
            if ps.table.node_of(req.lease_id) is not None:
                # a node re-read from the log after a refused batch holds it: another scheduler
                # placed it and our copy of the lease is older; catch-up brings its events
                continue
            shape = lease.requested_shape
            res = shape.resources
            if ps.book.limited(req.tenant) and (
                    why := quota_wait(self, ps, req, lease, now, batch, report)) is not None:
                self._wait(req, why, unplaced)
                continue
            # the pool's image policy decides which node trust levels this isolation may use
            trust_key = (shape.runtime, req.tenant)
            if trust_key in trust_of:
                allowed = trust_of[trust_key]
            else:
                trust = pool.image_policy.allowed_trust_levels(isolation=shape.runtime,
                                                               tenant=req.tenant)
                allowed = trust_of[trust_key] = (
                    None if len(trust) == len(TRUST_LEVELS) else tuple(sorted(trust)))
            held = False
            if guarded:
                node_id, fr, held = bf.place(
                    shape, placed_end_estimate(now, cfg.commit_timeout_seconds,
                                               lease.maximum_runtime_seconds),
                    packing=cfg.packing,  # type: ignore[arg-type]
                    allowed_trust_levels=allowed, lease_id=req.lease_id,
                    window=self.windows.usable(pool.pool_id, lease, now))
            else:
                node_id, fr = ps.table.place_fast(
                    shape, packing=cfg.packing,  # type: ignore[arg-type]
                    allowed_trust_levels=allowed)
            if node_id is None and held:
                # it fits now, but only where it would delay a blocked head's reservation
                # or run into an advance reservation or maintenance window (named in `why`)
                why = fr.wait_reasons([R.WAITING_FOR_RESERVATION]).to_dict()
                self.windows.explain(pool.pool_id, why)
                self._wait(req, why, unplaced)
                starts[req.lease_id] = self._start_estimate(bf, req, fr, cfg, now, allowed)
                continue
            if node_id is None:
                if fr.never_satisfiable:
                    lease = self._whole(lease)
                    lease.reject(now, "unschedulable", sorted(fr.failures))
                    self.reasons[req.lease_id] = fr.wait_reasons().to_dict()
                    batch.append(lease)
                    report.rejected += 1
                else:
                    hold, available = self._hold_and_available(pool, req.tenant, lease)
                    if hold > available:
                        # it could not pay even once capacity is free: say both, and preempt
                        # no one on behalf of a request that would still wait
                        why = fr.wait_reasons([R.INSUFFICIENT_CREDITS]).to_dict()
                        why.update(hold_microcredits=hold, available_microcredits=available)
                    else:
                        why = self._capacity_wait(ps, req, lease, fr, now, batch, report)
                        starts[req.lease_id] = self._start_estimate(bf, req, fr, cfg, now,
                                                                    allowed)
                    self._wait(req, why, unplaced)
                if len(batch) + len(allocs) + len(self._holds) >= MAX_MESSAGES_PER_BATCH:
                    self._close_batch(batch, allocs, now, report)
                    batch = []
                continue
            hold, available = self._hold_and_available(pool, req.tenant, lease)
            if hold > available:
                self._wait(req, {"tenant": [R.INSUFFICIENT_CREDITS],
                                 "hold_microcredits": hold, "available_microcredits": available},
                           unplaced)
                continue
            devices = self._devices_for(node_id, shape, allocs)
            if devices is None:
                self._wait(req, {"tenant": [R.WAITING_FOR_CAPACITY],
                                 "devices": f"too few free GPU devices of node {node_id} fit"},
                           unplaced)
                continue
            lease = self._whole(lease)
            restart = lease.restarts_on_placement
            epoch = lease.reserve(
                now,
                node_id=NodeId(node_id),
                commit_timeout_seconds=cfg.commit_timeout_seconds,
                hold_microcredits=hold,
                devices=devices,
            )
            if restart and restart_job(self, ps, lease, node_id, now):
                heapq.heappush(self._deadlines, (lease.next_due_at() or now, req.lease_id))
            lid = LeaseId(req.lease_id)
            on_node = allocs.get(node_id)
            if on_node is None:
                allocs[node_id] = [(lid, res, devices)]
            else:
                on_node.append((lid, res, devices))
            batch.append(lease)
            if hold:
                # recorded when the batch closes, with the tenant's other holds of the batch,
                # as ONE event on its account (`Account.hold_many`)
                holds = self._holds.get(req.tenant)
                if holds is None:
                    holds = self._holds[req.tenant] = []
                holds.append((f"hold-{lid}-{epoch}", lid, hold))
                self._held[req.tenant] = self._held.get(req.tenant, 0) + hold
            ps.table.allocate(node_id, req.lease_id, res, tenant=req.tenant)
            bf.placed(req.lease_id)
            self._track(ps, lease)
            self.reasons.pop(req.lease_id, None)
            heapq.heappush(self._deadlines, (lease.reservation_deadline or now, req.lease_id))
            if getattr(lease, "trace_parent", None) is not None:  # older snapshots: none
                self._placing.append((lease, time.time_ns()))
            report.placed += 1
            # one entry of `batch` per event, plus one event per node placed on and one per
            # account holding credits
            if len(batch) + len(allocs) + len(self._holds) >= MAX_MESSAGES_PER_BATCH:
                self._close_batch(batch, allocs, now, report)
                batch = []
        self._close_batch(batch, allocs, now, report)
        self._settle(report)
        position = 0
        for req in unplaced:
            lease = self.aggregates.peek(UUID(req.lease_id))
            if isinstance(lease, (Lease, QueuedLease)) and lease.state is LeaseState.QUEUED:
                queue.requeue(req)
                position += 1
                self._note_position(bf, req.lease_id, position, starts.get(req.lease_id))
        report.waiting += len(unplaced)

    # -- backfill: reservations, positions, start estimates ---------------------------------

    def _lease_end(self, lease_id: str) -> LeaseEnd | None:
        lease = self.aggregates.get(UUID(lease_id))
        if not isinstance(lease, Lease):
            return None
        return lease.resources, lease_end_estimate(lease)

    def _start_estimate(self, bf: Backfill, req: PendingRequest, fr: FilterResult,
                        cfg: Any, now: float, allowed: tuple[str, ...] | None) -> float | None:
        """When a request that waits for capacity may start: its reservation's start if it
        is (or now becomes) its band's head and backfill is on, else the earliest time the
        running leases' deadlines free enough for it on one node (a bound, not a promise)."""
        if self.backfill:
            band = band_of(req.priority_class, req.enqueued_at, now,
                           dict(cfg.priority_classes), float(cfg.aging_seconds_per_rank))
            held = bf.blocked(req.lease_id, req.shape, band, allowed)
            if held is not None:
                return held.start_at
        key = (req.shape, allowed)
        if key not in bf.estimates:  # once per shape a cycle: the walk visits every candidate
            found = bf.earliest(req.shape.resources, [*fr.eligible.tolist(), *fr.busy.tolist()])
            bf.estimates[key] = None if found is None else found[0]
        return bf.estimates[key]

    def _note_position(self, bf: Backfill, lease_id: str, position: int,
                       start: float | None) -> None:
        """Add the request's place in the pool's queue (1 = next) and its start estimate to
        its reasons, for `why`."""
        why = self.reasons.get(lease_id)
        if why is None:
            return
        reserved = bf.reservation_of(lease_id) if self.backfill else None
        why["queue"] = {"position": position, "estimated_start_at": start,
                        "reserved": reserved is not None}
        if reserved is not None:
            why["queue"]["reserved_node_id"] = reserved.node_id

    def _whole(self, lease: Lease | QueuedLease) -> Lease:
        """The Lease itself, rebuilt from its compact record if it is one (to record events)."""
        if isinstance(lease, QueuedLease):
            whole = self.aggregates.promote(lease.id)
            assert isinstance(whole, Lease)
            return whole
        return lease

    def _close_batch(self, batch: list[Aggregate], allocs: dict[str, list[Placed]],
                     now: float, report: CycleReport) -> None:
        """Record each node's placements of this batch as one event on the node, and each
        tenant's credit holds as one event on its account, then send the batch
        (`_commit_batch`); `allocs` and the holds are emptied."""
        for node_id, placed in allocs.items():
            node = self.aggregates[_node_uuid(node_id)]
            assert isinstance(node, Node)
            node.allocate_many(placed, now)
            batch.append(node)
        allocs.clear()
        for tenant, holds in self._holds.items():
            acc = self.aggregates[_account_uuid(tenant)]
            assert isinstance(acc, Account)
            acc.hold_many(holds, now)
            batch.append(acc)
        self._holds.clear()
        self._held.clear()
        self._commit_batch(batch, report)

    def _commit_batch(self, batch: list[Aggregate], report: CycleReport) -> None:
        """Send `batch` as one atomic save and return while it is in flight, so the next batch
        is planned during the round trip. The batch before it is settled first: a save that
        shares a subject with one not yet acknowledged would carry a stale expectation, and a
        batch planned on top of a refused one is void — it is dropped unsent and everything
        both touched is re-read from the log, so its requests are planned again, never lost."""
        placing, self._placing = self._placing, []
        unique = list({a.id: a for a in batch}.values())
        try:
            settled = self._settle(report)
        except Exception:
            self._void(unique, placing, report, quiet=True)  # planned on an unknown outcome
            raise
        if not settled:
            self._void(unique, placing, report)
            return
        if not unique:
            return
        try:
            pending = self.app.save_nowait(*unique)
        except IntegrityError:  # refused before sending (e.g. a version the recorder knows)
            report.conflicts += 1
            self._void(unique, placing, report)
            return
        self._inflight = _InFlight(pending, unique, placing)

    def _settle(self, report: CycleReport) -> bool:
        """Wait for the batch in flight, if any; False if it was refused (then its aggregates
        have been re-read from the log and its placements no longer count)."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return True
        try:
            flight.pending.wait()
        except IntegrityError:
            # someone else wrote one of these first: forget our in-memory view of them and
            # re-read the log; the requests are still queued and the next cycle retries
            report.conflicts += 1
            self._void(flight.aggregates, flight.placing, report)
            return False
        except Exception:
            # not known whether it landed (a timeout, the bus gone): the log says; re-read
            # what it touched, as far as the bus allows, and let the cycle fail
            self._void(flight.aggregates, flight.placing, report, quiet=True)
            raise
        report.batches += 1
        self._saved(flight.pending.ids)
        self._end_spans(flight.placing, saved=True)
        self._settled(flight.aggregates)
        return True

    def _settled(self, aggs: list[Aggregate]) -> None:
        """Leases our acknowledged save ended (rejected, voided) leave memory."""
        for a in aggs:
            if isinstance(a, Lease) and a.is_terminal:
                self._forget(a)

    def _saved(self, ids: list[int]) -> None:
        """Remember where an acknowledged batch of ours sits in the log (an atomic batch is
        contiguous; anything else is simply read back as before)."""
        if (ids and ids[-1] - ids[0] + 1 == len(ids) and ids[0] > self.position
                and (not self._own or self._own[-1][1] < ids[0])):
            self._own.append((ids[0], ids[-1]))

    def _void(self, aggs: list[Aggregate], placing: list[tuple[Lease, int]],
              report: CycleReport, *, quiet: bool = False) -> None:
        """The placements in `aggs` did not land: uncount them and re-index from the log.
        Their unsaved events are dropped first, so no later save can carry them; should the
        log not answer, the in-memory objects stay until it does (as after a failed save)."""
        self._end_spans(placing, saved=False)
        lost = sum(isinstance(a, Lease) and a.state is LeaseState.RESERVED for a in aggs)
        report.placed = max(0, report.placed - lost)
        for a in aggs:
            a.collect_events()
        try:
            self._reload(aggs)
        except Exception:
            if not quiet:
                raise
            log.exception("could not re-read %d aggregates after a failed save", len(aggs))

    def _end_spans(self, placing: list[tuple[Lease, int]], *, saved: bool) -> None:
        for lease, started_ns in placing:
            # one `place` span per placement, in the trace of the request that asked for it
            span = observability.child_span("place", lease.trace_parent, start_time=started_ns,
                                            attributes={"pool.lease_id": str(lease.id),
                                                        "pool.node_id": str(lease.node_id),
                                                        "pool.pool_id": str(lease.pool_id),
                                                        "pool.saved": saved})
            span.end()

    def _devices_for(self, node_id: str, shape: Shape, allocs: dict[str, list[Placed]]
                     ) -> tuple[str, ...] | None:
        """The node's GPU devices for this placement (domain.devices), past those of this
        batch's placements on it not yet recorded; () when it binds none."""
        node = self.aggregates.get(_node_uuid(node_id))
        if not isinstance(node, Node) or not node.capabilities.devices:
            return ()
        pending = [d for item in allocs.get(node_id, ()) for d in item[2]]
        return node.choose_devices(shape, pending)

    def _hold_and_available(self, pool: Pool, tenant: str,
                            lease: Lease | QueuedLease) -> tuple[int, int]:
        """The credit hold the lease needs in this pool, and what its tenant has available."""
        hold = pool.hold_for(lease.requested_shape, lease.maximum_runtime_seconds)
        acc = self.aggregates.get(_account_uuid(tenant))
        if not isinstance(acc, Account):
            return hold, 0
        return hold, acc.available - self._held.get(tenant, 0)  # less this batch's holds

    def _wait(self, req: PendingRequest, reasons: dict[str, Any], unplaced: list[PendingRequest]) -> None:
        self.reasons[req.lease_id] = reasons
        unplaced.append(req)

    # -- preempting -------------------------------------------------------------------------

    def _capacity_wait(
        self,
        ps: PoolState,
        req: PendingRequest,
        lease: Lease | QueuedLease,
        fr: FilterResult,
        now: float,
        batch: list[Aggregate],
        report: CycleReport,
    ) -> dict[str, Any]:
        """Why a request that fits no node now waits; may notice victims on its behalf (added
        to `batch`, so they land with the cycle's placements)."""
        if not ps.pool.config.preemption.enabled:
            return fr.wait_reasons([R.WAITING_FOR_CAPACITY]).to_dict()
        pending = self._pending_preemption(req.lease_id)
        if pending is None and self._plans_left > 0:
            self._plans_left -= 1
            plan = self._plan_preemption(ps, req, lease, fr, now)
            noticed = [] if plan is None else self._notice_victims(ps, plan, now, report)
            if plan is not None and noticed:
                batch += noticed
                pending = PendingPreemption(plan.node_id, tuple(str(v.id) for v in noticed))
                self._preempting_for[req.lease_id] = pending
        if pending is None:
            return fr.wait_reasons([R.WAITING_FOR_CAPACITY]).to_dict()
        overdue = [v for v in pending.victims
                   if isinstance(vl := self.aggregates.get(UUID(v)), Lease)
                   and vl.preemption_overdue(now)]
        out = fr.wait_reasons([R.WAITING_FOR_PREEMPTION]).to_dict()
        out["preemption"] = {"node_id": pending.node_id, "victims": list(pending.victims),
                             "overdue": overdue}
        return out

    def _pending_preemption(self, lease_id: str) -> PendingPreemption | None:
        """The request's earlier preemption while any of its victims still holds capacity on
        that node; preempting again meanwhile would stop more work than the request needs."""
        pending = self._preempting_for.get(lease_id)
        if pending is None:
            return None
        for vid in pending.victims:
            victim = self.aggregates.get(UUID(vid))
            # a victim back in `running` means the notice never landed (a lost save): replan
            if (isinstance(victim, Lease) and victim.state in _LEAVING
                    and victim.node_id == pending.node_id):
                return pending
        del self._preempting_for[lease_id]  # all freed: placement (or a new plan) takes over
        return None

    def _plan_preemption(
        self, ps: PoolState, req: PendingRequest, lease: Lease | QueuedLease, fr: FilterResult,
        now: float,
    ) -> PreemptionPlan | None:
        if not fr.busy.size:
            return None
        candidates = [
            c for i in fr.busy if (c := self._candidate(ps, ps.table.node_id_at(int(i)))).leases
        ]
        if not candidates:
            return None
        plan = choose_victims(
            lease.requested_shape,
            candidates,
            _rank(ps.pool, req.priority_class),
            self._tenants_over_share(ps, req, candidates),
            ps.pool.config.preemption.min_runtime_seconds,
            now,
            requester_tenant=req.tenant,
        )
        return plan if plan is not None and plan.victims else None

    def _candidate(self, ps: PoolState, node_id: str) -> NodeCandidate:
        """A busy node as the preemption policy sees it: only running, preemptible leases
        can be victims (reserved ones have no work to lose yet, preempting ones are going)."""
        victims: list[RunningLease] = []
        for lid in ps.table.leases_on(node_id):
            lease = self.aggregates.get(UUID(lid))
            if (not isinstance(lease, Lease) or lease.state is not LeaseState.RUNNING
                    or not may_be_victim(ps, lease) or lease.started_at is None):
                continue
            victims.append(RunningLease(
                lease_id=lid,
                tenant=lease.tenant_id,
                priority_rank=_rank(ps.pool, lease.priority_class),
                resources=lease.resources,
                started_at=lease.started_at,
                last_checkpoint_at=lease.last_checkpoint_at,
                # a lease that reported a checkpoint can resume from it; one that never did
                # loses everything since it started
                checkpointable=lease.checkpointable or lease.last_checkpoint_at is not None,
            ))
        return NodeCandidate(node_id, ps.table.free_resources(node_id), tuple(victims))

    def _tenants_over_share(
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

    def _notice_victims(
        self, ps: PoolState, plan: PreemptionPlan, now: float, report: CycleReport,
        *, reason: str = PREEMPTED,
    ) -> list[Lease]:
        """Notice each victim (the ones the domain accepted are returned, to be saved)."""
        prem = ps.pool.config.preemption
        out: list[Lease] = []
        for vid in plan.victim_ids:
            victim = self.aggregates.get(UUID(vid))
            if not isinstance(victim, Lease):
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
            heapq.heappush(self._deadlines, (grace_deadline, vid))
            report.preempted += 1
        return out

    # -- answering why ----------------------------------------------------------------------

    def why(self, tenant: str, lease_id: str) -> dict[str, Any] | None:
        """Why a lease waits (or was rejected); None if this tenant has no such lease."""
        with self._lock:
            try:
                lease = self.aggregates.peek(UUID(lease_id))
            except ValueError:
                return None
            if not isinstance(lease, (Lease, QueuedLease)):
                ended = self._ended.get(lease_id)
                return dict(ended[1]) if ended is not None and ended[0] == tenant else None
            if lease.tenant_id != tenant:
                return None
            out: dict[str, Any] = {"lease_id": lease_id, "state": str(lease.state)}
            reasons = self.reasons.get(lease_id)
            if reasons is not None:
                out["reasons"] = reasons
            elif isinstance(lease, Lease) and lease.state is LeaseState.REJECTED:
                out["reasons"] = {"rejection_code": lease.rejection_code}
            else:
                out["reasons"] = {}
            queue = out["reasons"].get("queue")
            if isinstance(queue, dict):  # where it stands, said plainly (see _note_position)
                start = queue.get("estimated_start_at")
                out["position"] = queue.get("position")
                out["estimated_start_at"] = start
                if start is not None:
                    out["estimated_start_in_seconds"] = max(0.0, start - self.clock())
            return out

    def queue_positions(self, tenant: str, limit: int = 1000) -> list[dict[str, Any]]:
        """The tenant's waiting leases as the last cycle left them: pool, place in that pool's
        queue (1 = next), estimated start and whether it holds a backfill reservation; in
        queue order, pool by pool."""
        out: list[dict[str, Any]] = []
        with self._lock:
            for ps in self.pools.values():
                if ps.queue is None:
                    continue
                for req in ps.queue.requests_of(tenant):
                    lid = req.lease_id
                    queue = (self.reasons.get(lid) or {}).get("queue") or {}
                    out.append({"lease_id": lid, "pool": ps.pool.pool_id,
                                "priority_class": req.priority_class,
                                "queued_at": req.enqueued_at,
                                "position": queue.get("position"),
                                "estimated_start_at": queue.get("estimated_start_at"),
                                "reserved": bool(queue.get("reserved", False))})
        # not yet examined by a cycle: after those that were, oldest first
        out.sort(key=lambda r: (r["pool"], r["position"] is None, r["position"] or 0,
                                r["queued_at"]))
        return out[:limit]

    # -- running ----------------------------------------------------------------------------

    def next_due_in(self) -> float | None:
        """Seconds until the deadline sweep has work (None: no deadline held)."""
        with self._lock:
            if not self._deadlines:
                return None
            return self._deadlines[0][0] - self.clock()

    def run(self, stop: threading.Event, *, interval: float | None = None,
            until: Callable[[], bool] = lambda: False, signal: Signal | None = None) -> None:
        """Cycle until `stop` is set or `until()` (e.g. leadership lost). A cycle that found
        nothing to do waits for the next append on `signal` (at most `interval` seconds, or
        until the next deadline), or sleeps `interval` when there is no signal."""
        idle = IdleWait(stop, signal, fallback_seconds=interval)
        observability.watch_scheduler(self)  # the active scheduler reports queue and leases
        try:
            while not stop.is_set() and not until():
                try:
                    report = self.cycle()
                except Exception:
                    log.exception("scheduler cycle failed")
                    stop.wait(1.0)
                    continue
                if not (report.placed or report.rejected or report.voided or report.expired
                        or report.preempted):
                    idle(self.next_due_in())
        finally:
            observability.unwatch_scheduler(self)


@functools.lru_cache(maxsize=1 << 16)
def _node_uuid(node_id: str) -> UUID:
    """Node.create_id, remembered: a uuid5 per placement adds up at thousands per second."""
    return Node.create_id(node_id)


@functools.lru_cache(maxsize=1 << 12)
def _account_uuid(tenant: str) -> UUID:
    return Account.create_id(tenant)


def _rank(pool: Pool, priority_class: str) -> int:
    """The class's rank; a class since removed from the pool counts as the lowest one."""
    try:
        return pool.rank_of(priority_class)
    except DomainError:
        return min(dict(pool.config.priority_classes).values(), default=0)
