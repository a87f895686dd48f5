"""The scheduler's cycle, deadline sweep, run loop and `why` answers."""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from bus import observability
from workers import metrics
from workers.pending import QueuedLease
from workers.scheduler.placing import Placing
from workers.scheduler.state import OTHERS_DEADLINE_RETRY_SECONDS, CycleReport

log = logging.getLogger(__name__)
from domain.dependency import WAITING_FOR_DEPENDENCY
from domain.errors import DomainError
from domain.lease import Lease, LeaseState
from domain.pool import TenantPolicy
from workers.wake import IdleWait, Signal


class Scheduler(Placing):
    """Follows the log through `app`, decides placements, saves them through `app`."""

    def cycle(self, *, settle: bool = True) -> CycleReport:
        """Catch up, sweep deadlines, place what fits; one atomic batch per ≤900 messages.

        `settle=False` (the run loop) returns with the last batch still in flight: the next
        cycle's read overlaps its round trip, and it is settled before anything is saved on
        top of it (or by `settle`). With the default, every batch is acknowledged (or
        voided) when this returns."""
        with self._lock:
            self.catch_up(until_short=True)
            report = CycleReport()
            now = self.clock()
            self._plans_left = self.max_preemption_plans_per_cycle
            self._sweep(now, report)
            for ps in self.pools.values():
                if self.leads(ps.pool.pool_id):
                    self._place_pool(ps, now, report)
            if self.decisions is not None:
                self.decisions.flush()  # one batch per pool, bounded; the rest next cycle
            if settle:
                self._settle(report)
            observability.record_cycle(report)
            metrics.record_cycle(report)
            return report

    def settle(self) -> CycleReport:
        """Wait for the batch a `cycle(settle=False)` left in flight, if any (voided and
        re-read if it was refused)."""
        with self._lock:
            report = CycleReport()
            self._settle(report)
            observability.record_cycle(report)
            metrics.record_cycle(report)
            return report

    def _sweep(self, now: float, report: CycleReport) -> None:
        """Void uncommitted reservations and expire silent leases whose time has come."""
        batch: list[Aggregate] = []
        others: list[tuple[float, str]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _due, lid = heapq.heappop(self._deadlines)
            lease = self.aggregates.get(UUID(lid))
            if not isinstance(lease, Lease) or lease.state is LeaseState.HELD:
                continue  # a held lease's timer is the reconciler's (it queues it)
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
                    batch += self._note_void(lease, now)
                    report.voided += 1
                else:
                    # never recycled silently: capacity stays held until the agent confirms
                    lease.expire(now, reason)
                    lease.begin_reconciliation(now)
                    report.expired += 1
                    if lease.gang is not None:  # its running peers go with it, in this save
                        batch += self._gang_peers_expired(lease, now, report)
            except DomainError:
                continue
            batch.append(lease)
            if len(batch) >= 900:
                self._save(batch, report)
                batch = []
        for item in others:
            heapq.heappush(self._deadlines, item)
        self._save(batch, report)

    def _note_void(self, lease: Lease, now: float) -> list[Aggregate]:
        """The tenant's policy, noting the reservation that timed out (Pool.admit_after_voids
        refuses its requests past the pool's limit); nothing without a policy or a limit."""
        ps = self.pools.get(lease.pool_id)
        policy = self.aggregates.get(TenantPolicy.create_id(lease.pool_id, lease.tenant_id))
        if ps is None or not isinstance(policy, TenantPolicy):
            return []
        return [policy] if ps.pool.note_voided_reservation(policy, now) else []

    def _note_overdue(self, lease: Lease, now: float, report: CycleReport) -> None:
        """A victim past its grace without a stop confirmation keeps its capacity: no expiry
        reason covers it (only its lease deadline or lost heartbeats do, and the sweep applies
        those), so the requester keeps waiting and `why` names the overdue victim."""
        if lease.preemption_overdue(now):
            report.overdue += 1
            log.warning("lease %s is past its preemption grace and not confirmed stopped",
                        lease.id)

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
