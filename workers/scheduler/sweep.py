"""The scheduler's deadline sweep: reservations not committed in time voided, silent leases
expired, each in the fold and saved through the batch writer."""

from __future__ import annotations

import heapq
import logging
from uuid import UUID

from eventsourcing.domain import Aggregate

from domain.account import Account
from domain.errors import DomainError
from domain.gang import GANG_MEMBER_LOST
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.pool import TenantPolicy
from domain.resources import LeaseId
from workers.scheduler.batches import BatchWriter
from workers.scheduler.folding import SchedulerFold
from workers.scheduler.state import OTHERS_DEADLINE_RETRY_SECONDS, CycleReport

log = logging.getLogger(__name__)


class DeadlineSweeper:
    """Walks the fold's deadline heap up to `now` and saves what came due."""

    def __init__(self, fold: SchedulerFold, writer: BatchWriter) -> None:
        self.fold = fold
        self.writer = writer

    def next_due_at(self) -> float | None:
        """When the sweep next has work (None: no deadline held)."""
        deadlines = self.fold.deadlines
        return deadlines[0][0] if deadlines else None

    def sweep(self, now: float, report: CycleReport) -> None:
        """Void uncommitted reservations and expire silent leases whose time has come."""
        fold = self.fold
        deadlines = fold.deadlines
        batch: list[Aggregate] = []
        others: list[tuple[float, str]] = []
        while deadlines and deadlines[0][0] <= now:
            _due, lid = heapq.heappop(deadlines)
            lease = fold.aggregates.get(UUID(lid))
            if not isinstance(lease, Lease) or lease.state is LeaseState.HELD:
                continue  # a held lease's timer is the reconciler's (it queues it)
            if not fold.leads(lease.pool_id):
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
                    batch += self._return_capacity(lease, now)
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
                self.writer.save(batch, report)
                batch = []
        for item in others:
            heapq.heappush(deadlines, item)
        self.writer.save(batch, report)

    def _note_void(self, lease: Lease, now: float) -> list[Aggregate]:
        """The tenant's policy, noting the reservation that timed out (Pool.admit_after_voids
        refuses its requests past the pool's limit); nothing without a policy or a limit."""
        ps = self.fold.pools.get(lease.pool_id)
        policy = self.fold.aggregates.get(TenantPolicy.create_id(lease.pool_id,
                                                                 lease.tenant_id))
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

    def _return_capacity(self, lease: Lease, now: float) -> list[Aggregate]:
        """A voided reservation's node capacity and credit hold given back."""
        fold = self.fold
        out: list[Aggregate] = []
        if lease.node_id is not None:
            node = fold.aggregates.get(Node.create_id(lease.node_id))
            if isinstance(node, Node) and node.free(LeaseId(str(lease.id)), now):
                out.append(node)
        acc = fold.aggregates.get(Account.create_id(lease.tenant_id))
        lid = LeaseId(str(lease.id))
        if isinstance(acc, Account) and acc.has_hold(lid):
            acc.release_hold(f"void-{lease.id}-{lease.epoch}", lid, now)
            out.append(acc)
        ps = fold.pools.get(lease.pool_id)
        if ps is not None:
            ps.table.free(str(lease.id))
            fold.track(ps, lease)
        return out

    def _gang_peers_expired(self, lease: Lease, now: float, report: CycleReport
                            ) -> list[Lease]:
        """A gang member expired (its heartbeats or its node lost): its running peers get one
        preemption notice with the pool's grace (`gang_member_lost`), back in line with it
        when the gang asked to be requeued, else ended."""
        ps = self.fold.pools.get(lease.pool_id)
        if ps is None or lease.gang is None:
            return []
        grace = ps.pool.config.preemption.grace_seconds
        out: list[Lease] = []
        for uid in lease.gang.member_ids(lease.tenant_id):
            peer = self.fold.aggregates.get(uid)
            if (uid == lease.id or not isinstance(peer, Lease)
                    or peer.state is not LeaseState.RUNNING):
                continue
            try:
                due = peer.notice_preemption(now, grace_seconds=grace,
                                             requeue=peer.requeue_when_preempted,
                                             reason=GANG_MEMBER_LOST)
            except DomainError:
                continue
            heapq.heappush(self.fold.deadlines, (due, str(uid)))
            report.preempted += 1
            out.append(peer)
        return out
