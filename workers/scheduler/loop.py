"""The scheduler: its fold state, planner, batch writer and deadline sweeper composed into
the cycle, the run loop and the `why` answers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from bus import observability
from domain.dependency import WAITING_FOR_DEPENDENCY
from domain.lease import Lease, LeaseState
from workers import metrics
from workers.pending import QueuedLease
from workers.scheduler.batches import BatchWriter
from workers.scheduler.folding import SchedulerFold
from workers.scheduler.planner import Planner
from workers.scheduler.state import CycleReport, PoolState
from workers.scheduler.sweep import DeadlineSweeper
from workers.wake import IdleWait, Signal

log = logging.getLogger(__name__)


class _Of:
    """An attribute of the scheduler that is one of a part's (read and written there)."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)  # type: ignore[arg-type]

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)  # type: ignore[arg-type]


class Scheduler:
    """Follows the log through `app` (its fold), plans placements (its planner), saves them
    through `app` (its batch writer) and voids or expires what came due (its sweeper)."""

    # the fold's state and settings, as callers have always reached them
    app = _Of("fold")
    clock = _Of("fold")
    position = _Of("fold")
    stop_after = _Of("fold")
    aggregates = _Of("fold")
    pools = _Of("fold")
    reasons = _Of("fold")
    windows = _Of("fold")
    leads = _Of("fold")
    decisions = _Of("fold")
    checkpoints = _Of("fold")
    maybe_behind = _Of("fold")
    pages_read_ahead = _Of("fold")
    pages_read_ahead_unused = _Of("fold")
    lease_end = _Of("fold")  # the method its pools' backfills hold (checkpoint rebinds it)
    # the planner's settings
    backfill = _Of("planner")
    max_examined_per_cycle = _Of("planner")
    max_preemption_plans_per_cycle = _Of("planner")
    # parts of the fold and the writer that tests look into
    _own = _Of("fold")
    _prefetch = _Of("fold")
    _ended = _Of("fold", "ended")
    _usage = _Of("fold", "usage")
    _deadlines = _Of("fold", "deadlines")
    _inflight = _Of("writer", "inflight")

    def __init__(self, app: Any, *, clock: Callable[[], float] = time.time,
                 planner: Planner | None = None) -> None:
        self.fold = SchedulerFold(app, clock=clock)
        self.planner = planner if planner is not None else Planner()
        self.writer = BatchWriter(self.fold)
        self.sweeper = DeadlineSweeper(self.fold, self.writer)
        self._lock = threading.RLock()

    def catch_up(self, *, until_short: bool = False) -> int:
        """Fold every event after `position` (workers.scheduler.folding)."""
        return self.fold.catch_up(until_short=until_short)

    def apply(self, event: Any, end: int = 0) -> None:
        self.fold.apply(event, end)

    def close(self) -> None:
        self.fold.close()

    def _next_read(self, position: int) -> tuple[int, int]:
        return self.fold._next_read(position)

    @property
    def checkpoint_lock(self) -> threading.RLock:
        """Held while a checkpoint is taken (workers.scheduler.checkpoint): the cycle's lock."""
        return self._lock

    def checkpoint_state(self) -> dict[str, Any] | None:
        """The fold, for a checkpoint: None while a batch is in flight (its outcome, and so
        the fold, are not known yet)."""
        if self.writer.busy:
            return None
        return self.fold.checkpoint_state()

    def restore_checkpoint(self, state: dict[str, Any]) -> None:
        self.fold.restore_checkpoint(state)

    def cycle(self, *, settle: bool = True) -> CycleReport:
        """Catch up, sweep deadlines, place what fits; one atomic batch per ≤900 messages.

        `settle=False` (the run loop) returns with the last batch still in flight: the next
        cycle's read overlaps its round trip, and it is settled before anything is saved on
        top of it (or by `settle`). With the default, every batch is acknowledged (or
        voided) when this returns."""
        with self._lock:
            fold = self.fold
            fold.catch_up(until_short=True)
            report = CycleReport()
            now = fold.clock()
            self.planner.begin_cycle()
            self.sweeper.sweep(now, report)
            for ps in fold.pools.values():
                if fold.leads(ps.pool.pool_id):
                    self._place_pool(ps, now, report)
            if fold.decisions is not None:
                fold.decisions.flush()  # one batch per pool, bounded; the rest next cycle
            if settle:
                self.writer.settle(report)
            observability.record_cycle(report)
            metrics.record_cycle(report)
            return report

    def settle(self) -> CycleReport:
        """Wait for the batch a `cycle(settle=False)` left in flight, if any (voided and
        re-read if it was refused)."""
        with self._lock:
            report = CycleReport()
            self.writer.settle(report)
            observability.record_cycle(report)
            metrics.record_cycle(report)
            return report

    def _place_pool(self, ps: PoolState, now: float, report: CycleReport) -> None:
        """A pool's queue planned, each plan sent as the next is planned."""
        planned = self.planner.plan(self.fold, ps, now)
        for plan in planned:
            self.writer.send(plan, now, report)
        report.waiting += planned.waiting

    def why(self, tenant: str, lease_id: str) -> dict[str, Any] | None:
        """Why a lease waits (or was rejected); None if this tenant has no such lease."""
        with self._lock:
            try:
                lease = self.aggregates.peek(UUID(lease_id))
            except ValueError:
                return None
            if not isinstance(lease, (Lease, QueuedLease)):
                held = self.aggregates.requested(UUID(lease_id))
                if held is not None and held.get("tenant_id") == tenant:
                    flow = held.get("workflow") or {}
                    reason = WAITING_FOR_DEPENDENCY if flow.get("after") else None
                    return {"lease_id": lease_id, "state": "held" if reason else "requested",
                            "reasons": self._held_reasons(reason, flow.get("after"))}
                ended = self.fold.ended.get(lease_id)
                return dict(ended[1]) if ended is not None and ended[0] == tenant else None
            if lease.tenant_id != tenant:
                return None
            out: dict[str, Any] = {"lease_id": lease_id, "state": str(lease.state)}
            reasons = self.reasons.get(lease_id)
            if reasons is not None:
                out["reasons"] = reasons
            elif isinstance(lease, Lease) and lease.state is LeaseState.REJECTED:
                out["reasons"] = {"rejection_code": lease.rejection_code}
            elif isinstance(lease, Lease) and lease.state is LeaseState.HELD:
                out["reasons"] = self._held_reasons(lease.held_reason, lease.after)
                if lease.held_until is not None:
                    out["reasons"]["held_until"] = lease.held_until
            elif lease.state in (LeaseState.QUEUED, LeaseState.REQUESTED):
                # waiting, but no cycle has looked at it yet: its place is not known either
                out["reasons"] = {"not_yet_examined": True}
                out["position"] = None
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

    def _held_reasons(self, reason: str | None, waits_for: Any) -> dict[str, Any]:
        """Why a held lease is out of the queue: its held reason and, waiting for other
        leases, those of them that have not ended (as far as this fold knows)."""
        out: dict[str, Any] = {"tenant": [reason] if reason else []}
        after = [str(d[0]) for d in waits_for or () if d]
        if after and reason == WAITING_FOR_DEPENDENCY:
            live = [d for d in after if _is_uuid(d) and UUID(d) in self.aggregates]
            out["waiting_for"] = live or after
        return out

    def pool_of(self, tenant: str, lease_id: str) -> str | None:
        """The pool of this tenant's lease, while it is held in memory (None: no such lease)."""
        with self._lock:
            try:
                lease = self.aggregates.peek(UUID(lease_id))
            except ValueError:
                return None
            if not isinstance(lease, (Lease, QueuedLease)) or lease.tenant_id != tenant:
                return None
            return str(lease.pool_id)

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

    def next_due_in(self) -> float | None:
        """Seconds until the deadline sweep has work (None: no deadline held)."""
        with self._lock:
            due = self.sweeper.next_due_at()
            return None if due is None else due - self.clock()

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
                    # the last batch stays in flight while the next cycle reads the log
                    report = self.cycle(settle=False)
                    busy = bool(report.placed or report.rejected or report.voided
                                or report.expired or report.preempted or self.maybe_behind)
                    checkpoints = self.checkpoints
                    if not busy or (checkpoints is not None
                                    and checkpoints.due(self, idle=False)):
                        self.settle()  # before a wait, and before a checkpoint is taken
                except Exception:
                    log.exception("scheduler cycle failed")
                    stop.wait(1.0)
                    continue
                if checkpoints is not None:
                    checkpoints.after_cycle(self, idle=not busy)
                if not busy:
                    idle(self.next_due_in())
        finally:
            try:
                self.settle()  # what the last cycle sent is acknowledged or voided
            except Exception:
                log.exception("the last batch's outcome is not known; the log says")
            observability.unwatch_scheduler(self)


def _is_uuid(text: str) -> bool:
    try:
        UUID(text)
    except ValueError:
        return False
    return True
