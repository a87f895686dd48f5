"""The scheduler's fold state: the log read and folded into pools, nodes, leases and the
queue (what the planner plans on)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import heapq
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from bus.recorders import LogRecorder, log_recorder
from bus.transcoder import EventDecoder
from domain.cohort import Cohort
from domain.fold import Fold
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.policy import reasons as R
from domain.policy.backfill import LeaseEnd, lease_end_estimate
from domain.policy.fairness import PendingRequest
from domain.pool import Pool, TenantPolicy
from domain.reservation import CapacityReservation
from domain.resources import Resources
from workers.pending import LeaseMemory, QueuedLease
from workers.quotas import remember_usage
from workers.reservations import Windows
from workers.scheduler.checkpoint import TRANSIENT, Checkpointer, rebind
from workers.scheduler.decisions import DecisionRecorder
from workers.scheduler.state import (
    DEADLINES_SLACK,
    ENDED_REMEMBERED,
    LONG_LIVED_FOLD,
    NOTIFICATION_PAGE,
    PendingPreemption,
    PoolState,
)


class SchedulerFold:
    """The scheduler's fold state: the log folded into pools, nodes, leases and the fair queue.

    `app` is where the log is read (`catch_up`); None: a fold fed by `apply` alone, as a
    simulator or a test builds one in memory."""

    def __init__(self, app: Any = None, *, clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.clock = clock
        self.position = 0
        self.stop_after: float | None = None  # fold only the events made by then (`--at`)
        # queued leases compactly; the rest whole, until an ended lease is settled
        self.aggregates = LeaseMemory()
        self._fold = Fold(self.aggregates)
        # the last ended leases, kept only to answer `why` about them
        self.ended: collections.OrderedDict[str, tuple[str, dict[str, Any]]] = (
            collections.OrderedDict())
        # which pools this scheduler places and sweeps (workers.pool_leaders: those it leads)
        self.leads: Callable[[str], bool] = lambda _pool_id: True
        self.pools: dict[str, PoolState] = {}
        self.reasons: dict[str, dict[str, Any]] = {}
        # where changed reasons and placements are recorded (workers.scheduler.decisions);
        # None: kept in memory only
        self.decisions: DecisionRecorder | None = None
        self._seq = 0
        # (due_at, lease_id) for reservations and running leases: the deadline sweep. An
        # ended lease's entries are dropped by `_compact_deadlines` once the heap has doubled
        # since the last compaction, so it stays within twice the live leases' entries
        self.deadlines: list[tuple[float, str]] = []
        self.deadlines_kept = 0  # its size after the last compaction
        self.usage: dict[str, tuple[str, Resources]] = {}  # lease -> (tenant, resources)
        # array (`max_running`) -> its leases holding capacity: the throttle's count
        self.array_holding: dict[str, set[str]] = {}
        # requester lease -> the preemption started for it; one at a time per request
        self.preempting_for: dict[str, PendingPreemption] = {}
        # advance reservations and maintenance windows, kept out of others' placements
        self.windows = Windows()
        # (first, last) notification ids of our acknowledged batches not yet passed by
        # catch_up, in log order: catch_up steps over them instead of reading them back
        self._own: collections.deque[tuple[int, int]] = collections.deque()
        # the mapper's to_domain_event, without its walk over the whole decoded state where
        # the stored event holds just one transcoded value (its timestamp); anything else
        # goes through the mapper
        self._decode = EventDecoder(app.mapper) if app is not None else None
        self._read_ahead: concurrent.futures.ThreadPoolExecutor | None = None
        # the log as this fold reads and writes it (bus.recorders); None: a fold in memory
        self.recorder: LogRecorder | None = (log_recorder(app.recorder) if app is not None
                                             else None)
        # bus.jetstream's read-ahead pages, told to remember every subject they pass (as
        # direct gets do), so that writing to an aggregate only read needs no look-up first
        self._prefetch = (self.recorder.prefetch
                          if self.recorder is not None and self.recorder.reads_ahead else None)
        if self.recorder is not None and self._prefetch is not None:
            self.recorder.remember_subjects_read = True
        # a read that does not finish fails the cycle (the run loop logs it and goes on)
        self._read_timeout = (self.recorder.timeout + 20.0 if self.recorder is not None
                              else 30.0)
        # the last catch-up stopped at a read-ahead page that was short, without an empty
        # page to say the log held no more: the next cycle follows without waiting
        self.maybe_behind = False
        self.pages_read_ahead = 0  # pages catch-up took from a read ahead
        self.pages_read_ahead_unused = 0  # reads ahead it could not use (asked for the wrong range)
        # where this fold is checkpointed and, before the first catch-up, restored from
        # (workers.scheduler.checkpoint); None: always a full replay
        self.checkpoints: Checkpointer | None = None

    def catch_up(self, *, until_short: bool = False) -> int:
        """Apply every event after `position`; returns how many were read. The ranges our own
        acknowledged batches occupy are stepped over unread: their events are in memory.

        `until_short` (a cycle): stop at the first page that held fewer events than asked
        for, what the log held when it was read, instead of reading on until a page comes
        back empty; under a steady stream of requests that chase never ended, and nothing
        read meanwhile was placed. `maybe_behind` then says the log may hold more."""
        if self.checkpoints is not None and not self.position:
            self.checkpoints.restore(self)  # once: then only the events after it are read
        n = self._catch_up(until_short)
        if n >= LONG_LIVED_FOLD:
            # a replay (start-up, or a long absence) built state that lives as long as the
            # scheduler: move it out of the cyclic collector's sight, or every full collection
            # re-walks millions of objects (docs/performance-log.md).
            # Freed objects are still freed by reference counting; only reference cycles
            # that exist now and die later would stay (the fold's aggregates hold none)
            gc.freeze()
        return n

    def _catch_up(self, until_short: bool) -> int:
        n = 0
        self.maybe_behind = False
        own = self._own
        decode = self._decode
        if decode is None:  # a fold built in memory: nothing to read
            return 0
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
                    if own and own[0][0] == start + limit:
                        # the read ended where our next acknowledged batch begins, so all of
                        # it is stored, and none of it is an event to fold (a snapshot an
                        # older log holds, a stray): past it, or the batch is never stepped over
                        self.position = start + limit - 1
                        continue
                    return n
                # a full page may have more behind it; so may any page of a read-ahead
                # (`prefetch` returns what is stored now, perhaps less): read until one is
                # empty, or (a cycle's) stop here and say so
                more = len(page) == limit or (self._prefetch is not None and not until_short)
                if not more and self._prefetch is not None:
                    self.maybe_behind = True
                if more:
                    at, size = self._next_read(page[-1].id)
                    ahead = (at, size, self._read(at, size))
                version_of = self.aggregates.version_of
                stop = self.stop_after
                for notification in page:
                    known = version_of(notification.originator_id)
                    # our own writes come back through the log: skip them before decoding
                    if known is None or notification.originator_version > known:
                        event = decode(notification)
                        if stop is not None and event.timestamp.timestamp() > stop:
                            return n
                        self.apply(event, notification.id)
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

    def saved(self, ids: list[int]) -> None:
        """Remember where an acknowledged batch of ours sits in the log (an atomic batch is
        contiguous; anything else is simply read back as before): catch-up steps over it."""
        if (ids and ids[-1] - ids[0] + 1 == len(ids) and ids[0] > self.position
                and (not self._own or self._own[-1][1] < ids[0])):
            self._own.append((ids[0], ids[-1]))

    def checkpoint_state(self) -> dict[str, Any] | None:
        """The fold as a checkpoint holds it: every attribute but the reading machinery and
        the settings given by whoever made it (None before anything was folded)."""
        if not self.position:
            return None
        return {k: v for k, v in vars(self).items() if k not in TRANSIENT}

    def restore_checkpoint(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's fold (`checkpoint_state` of another process)."""
        for name, value in state.items():
            setattr(self, name, value)
        rebind(self)

    def lease_end(self, lease_id: str) -> LeaseEnd | None:
        """A lease holding capacity: its amount and estimated end (what backfill asks)."""
        lease = self.aggregates.get(UUID(lease_id))
        if not isinstance(lease, Lease):
            return None
        return lease.resources, lease_end_estimate(lease)

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
            return self._prefetch(start, limit, start + limit - 1)
        assert self.recorder is not None  # a fold in memory reads nothing (_catch_up)
        return self._reader().submit(
            self.recorder.select_notifications, start=start, limit=limit)

    def _reader(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._read_ahead is None:
            self._read_ahead = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="scheduler-read-ahead")
        return self._read_ahead

    def apply(self, event: Any, end: int = 0) -> None:
        """Fold one event; `end`: its sequence in the log, where known."""
        compact = self.aggregates.absorb(event)
        if compact is not False:  # a request, or its queueing: held compactly
            if isinstance(compact, QueuedLease):
                compact.end = end
                self.enqueue(compact)
            return
        agg = self._fold.step(event)
        if agg is None:
            return  # our own write coming back, already applied in memory
        self.index(agg)

    def index(self, agg: Aggregate) -> None:
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
                self.forget(lease)
            return
        lid = str(lease.id)
        self.track(ps, lease)
        if lease.state is LeaseState.QUEUED:
            self.enqueue(lease)
            return
        if lid in ps.queue:
            ps.queue.remove(lid)
        if lease.is_terminal:
            self.forget(lease)
            return
        self.reasons.pop(lid, None)
        if self.decisions is not None:
            self.decisions.forget(lid)
        self.preempting_for.pop(lid, None)
        due = lease.next_due_at()
        if due is not None:
            heapq.heappush(self.deadlines, (due, lid))

    def enqueue(self, lease: Lease | QueuedLease) -> None:
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

    def forget(self, lease: Lease) -> None:
        """An ended lease leaves memory (a preempted one stays: it may be requeued); its
        state and reasons are kept a while for `why`."""
        if lease.state is LeaseState.PREEMPTED:
            return
        lid = str(lease.id)
        reasons = self.reasons.pop(lid, None)
        if self.decisions is not None:
            self.decisions.forget(lid)
        if reasons is None and lease.state is LeaseState.REJECTED:
            reasons = {"rejection_code": lease.rejection_code}
        self.ended[lid] = (lease.tenant_id, {"lease_id": lid, "state": str(lease.state),
                                              "reasons": reasons or {}})
        if len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)
        self.preempting_for.pop(lid, None)
        self.aggregates.pop(lease.id, None)
        # nor does the application's cache of it (a re-read after a refused batch put it
        # there) or the recorder's memory of where its subject ends
        if self.app is not None:
            cache = self.app.repository.cache
            if cache is not None:
                with contextlib.suppress(KeyError):
                    cache.get(lease.id, evict=True)
            if self.recorder is not None:
                self.recorder.forget(lease.id)
        if len(self.deadlines) > 2 * self.deadlines_kept + DEADLINES_SLACK:
            self._compact_deadlines()

    def _compact_deadlines(self) -> None:
        """Drop the deadline heap's entries of leases no longer held (ended and forgotten):
        the sweep would skip them when their time came, but until then they took memory for
        as long as a commit timeout or a maximum runtime. Amortised: it runs only once the heap
        has doubled since the last time."""
        held = self.aggregates
        live = {(due, lid) for due, lid in self.deadlines if UUID(lid) in held}
        self.deadlines = list(live)
        heapq.heapify(self.deadlines)
        self.deadlines_kept = len(self.deadlines)

    def throttled(self, array: str, lease: Lease | QueuedLease) -> dict[str, Any] | None:
        """Why a lease of a throttled array waits: `max_running` of it hold capacity already;
        None when it may be placed."""
        limit = lease.max_running
        holding = self.array_holding.get(array)
        if limit is None or holding is None or len(holding) < limit:
            return None
        return {"tenant": [R.ARRAY_THROTTLED], "max_running": limit, "array_id": array}

    def track(self, ps: PoolState, lease: Lease) -> None:
        """Keep each tenant's usage (the DRF numerator) = its capacity-holding leases, and
        each throttled array's leases that hold capacity."""
        self.windows.track(lease)
        lid = str(lease.id)
        if lease.array_id is not None:
            holding = self.array_holding.setdefault(lease.array_id, set())
            if lease.holds_capacity:
                holding.add(lid)
            else:
                holding.discard(lid)
                if not holding:
                    del self.array_holding[lease.array_id]
        tracked = self.usage.get(lid)
        holds = lease.holds_capacity
        assert ps.queue is not None
        if holds and tracked is None:
            self.usage[lid] = (lease.tenant_id, lease.resources)
            ps.queue.add_usage(lease.tenant_id, lease.resources)
        elif not holds and tracked is not None:
            del self.usage[lid]
            ps.queue.released(tracked[0], tracked[1])
        else:
            return
        if ps.decay.half_life_seconds:
            remember_usage(ps, lease)
