"""The scheduler's batch writer: a plan saved as one atomic batch, sent while the next is
planned, then acknowledged, or voided and re-read from the log."""

from __future__ import annotations

import logging
import time
from typing import Any

from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError

from bus import observability
from domain.account import Account
from domain.lease import Lease, LeaseState
from domain.node import Node
from workers import metrics
from workers.scheduler.folding import SchedulerFold
from workers.scheduler.plan import Plan
from workers.scheduler.state import CycleReport, InFlight, account_uuid, node_uuid

log = logging.getLogger(__name__)


class BatchWriter:
    """Saves plans (and the deadline sweep's changes) through the fold's application, one
    atomic batch each; a refused batch's aggregates are re-read into the fold."""

    def __init__(self, fold: SchedulerFold) -> None:
        self.fold = fold
        self.app: Any = fold.app
        # the batch whose acknowledgement is awaited while the next one is planned
        self.inflight: InFlight | None = None

    @property
    def busy(self) -> bool:
        """A batch is in flight (a checkpoint waits for it)."""
        return self.inflight is not None

    def save(self, aggs: list[Aggregate], report: CycleReport) -> bool:
        """Save `aggs` now and wait for the acknowledgement (the sweep's changes)."""
        unique = list({a.id: a for a in aggs}.values())
        if not unique:
            return True
        try:
            settled = self.settle(report)  # a batch still in flight from the last cycle
        except Exception:
            self._void(unique, [], report, quiet=True)  # planned on an unknown outcome
            raise
        if not settled:  # planned on top of a refused batch: void, as `_commit_batch` does
            self._void(unique, [], report)
            return False
        try:
            recordings = self.app.save(*unique)
            report.batches += 1
            self.fold.saved([r.notification.id for r in recordings or ()])
            self._settled(unique)
            return True
        except IntegrityError:
            # someone else wrote one of these first: forget our in-memory view of them and
            # re-read the log; the requests are still queued and the next cycle retries
            report.conflicts += 1
            for a in unique:
                self.fold.aggregates.pop(a.id, None)
            self._reload(unique)
            return False

    def send(self, plan: Plan, now: float, report: CycleReport) -> None:
        """Record each node's placements of the plan as one event on the node, and each
        tenant's credit holds as one event on its account, then send it all as one batch
        (`_commit_batch`), returning while it is in flight."""
        report.placed += len(plan.reserved)
        report.rejected += len(plan.rejected)
        report.preempted += plan.preempted
        # every placement: its span (when traced) and its wait (metrics) once it is saved
        started = time.time_ns()
        placing = [(lease, started) for lease in plan.reserved]
        aggregates = self.fold.aggregates
        batch = list(plan.aggregates)
        for node_id, placed in plan.allocations.items():
            node = aggregates[node_uuid(node_id)]
            assert isinstance(node, Node)
            node.allocate_many(placed, now)
            batch.append(node)
        for tenant, holds in plan.holds.items():
            acc = aggregates[account_uuid(tenant)]
            assert isinstance(acc, Account)
            acc.hold_many(holds, now)
            batch.append(acc)
        self._commit_batch(batch, placing, report, plan.ends)

    def _hint_ends(self, aggs: list[Aggregate], ends: dict[Any, tuple[int, int]]) -> None:
        """Tell the recorder where the subjects of the compact leases this save promoted end
        (their record kept it): past its bound of remembered subjects, a backlog's oldest
        requests were forgotten, and each batch was held up by a look-up of ~900 subjects."""
        if not ends:
            return
        hints = {a.id: ends[a.id] for a in aggs if a.id in ends}
        if hints and self.fold.recorder is not None:
            self.fold.recorder.remember_ends(hints)

    def _reload(self, aggs: list[Aggregate]) -> None:
        fold = self.fold
        for a in aggs:
            fresh = self.app.repository.get(a.id)
            fold.aggregates[fresh.id] = fresh
        for a in aggs:
            fold.index(fold.aggregates[a.id])

    def _commit_batch(self, batch: list[Aggregate], placing: list[tuple[Lease, int]],
                      report: CycleReport, ends: dict[Any, tuple[int, int]]) -> None:
        """Send `batch` as one atomic save and return while it is in flight, so the next batch
        is planned during the round trip. The batch before it is settled first: a save that
        shares a subject with one not yet acknowledged would carry a stale expectation, and a
        batch planned on top of a refused one is void — it is dropped unsent and everything
        both touched is re-read from the log, so its requests are planned again, never lost."""
        unique = list({a.id: a for a in batch}.values())
        try:
            settled = self.settle(report)
        except Exception:
            self._void(unique, placing, report, quiet=True)  # planned on an unknown outcome
            raise
        if not settled:
            self._void(unique, placing, report)
            return
        if not unique:
            return
        self._hint_ends(unique, ends)
        try:
            pending = self.app.save_nowait(*unique)
        except IntegrityError:  # refused before sending (e.g. a version the recorder knows)
            report.conflicts += 1
            self._void(unique, placing, report)
            return
        self.inflight = InFlight(pending, unique, placing)

    def settle(self, report: CycleReport) -> bool:
        """Wait for the batch in flight, if any; False if it was refused (then its aggregates
        have been re-read from the log and its placements no longer count)."""
        flight, self.inflight = self.inflight, None
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
        self.fold.saved(flight.pending.ids)
        self._end_spans(flight.placing, saved=True)
        self._settled(flight.aggregates)
        return True

    def _settled(self, aggs: list[Aggregate]) -> None:
        """Leases our acknowledged save ended (rejected, voided) leave memory."""
        for a in aggs:
            if isinstance(a, Lease) and a.is_terminal:
                self.fold.forget(a)

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
        if saved:
            metrics.placed_many(
                (str(lease.pool_id), (lease.reserved_at or lease.requested_at) - lease.requested_at)
                for lease, _ns in placing)
        for lease, started_ns in placing:
            if getattr(lease, "trace_parent", None) is None:  # untraced (older snapshots: none)
                continue
            # one `place` span per placement, in the trace of the request that asked for it
            span = observability.child_span("place", lease.trace_parent, start_time=started_ns,
                                            attributes={"pool.lease_id": str(lease.id),
                                                        "pool.node_id": str(lease.node_id),
                                                        "pool.pool_id": str(lease.pool_id),
                                                        "pool.saved": saved})
            span.end()
