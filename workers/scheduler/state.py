"""The scheduler's per-pool state, cycle report and tuning constants."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from domain.account import Account
from domain.errors import DomainError
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.policy.backfill import Backfill
from domain.policy.fairness import DecayedUsage, FairQueue
from domain.policy.gang import LIVE_HOLD_SECONDS, GangHolds
from domain.policy.placement import NodeTable
from domain.pool import Pool
from domain.quota import QuotaBook
from domain.resources import TRUST_LEVELS, LeaseId, Resources

Placed = tuple[LeaseId, Resources, tuple[str, ...]]  # a placement on a node: lease, amount, devices
# States of a victim on its way out that still hold its node's capacity.
LEAVING = frozenset(
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
# entries the deadline heap may hold beyond twice its live ones before ended leases' are dropped
DEADLINES_SLACK = 1024
# the cyclic collector's thresholds in a process that schedules or answers commands: a
# placement or a request makes a few dozen short-lived containers (events, their state dicts,
# stored events), so with CPython's default of 700 a young collection ran every ~20 of them
# and promoted what was in flight, which the oldest generation then walked again and again:
# in the commands process a full pass every few seconds, each one stalling every request
# (docs/performance-log.md)
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc() -> None:
    """Raise the collector's thresholds to GC_THRESHOLDS (never lower them): for processes
    that run the scheduler or the command responders. Reference counting still frees
    everything that is not a cycle."""
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
    # the waiting head gang's hold on its best domain's free nodes (workers.scheduler.gangs),
    # and what it keeps on each held node
    gang_holds: GangHolds = field(
        default_factory=lambda: GangHolds(max_hold_seconds=LIVE_HOLD_SECONDS))
    gang_hold_need: dict[str, Resources] = field(default_factory=dict)

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
class InFlight:
    """A cycle's batch sent and not yet acknowledged, with what to undo if it is refused."""

    pending: Any  # workers.application.core.PendingSave
    aggregates: list[Aggregate]
    placing: list[tuple[Lease, int]]


@dataclass(frozen=True)
class PendingPreemption:
    """A waiting request's claim on a node whose victims were noticed on its behalf."""

    node_id: str
    victims: tuple[str, ...]


def node_uuid(node_id: str) -> UUID:
    """Node.create_id (remembered there: a uuid5 per placement adds up)."""
    return Node.create_id(node_id)


def account_uuid(tenant: str) -> UUID:
    return Account.create_id(tenant)


def class_rank(pool: Pool, priority_class: str) -> int:
    """The class's rank; a class since removed from the pool counts as the lowest one."""
    try:
        return pool.rank_of(priority_class)
    except DomainError:
        return min(dict(pool.config.priority_classes).values(), default=0)


def allowed_trust(pool: Pool, isolation: str, tenant: str) -> tuple[str, ...] | None:
    """The node trust levels the pool's image policy lets `isolation` of `tenant` use (None:
    any, so placement need not filter on trust)."""
    trust = pool.image_policy.allowed_trust_levels(isolation=isolation, tenant=tenant)
    return None if len(trust) == len(TRUST_LEVELS) else tuple(sorted(trust))
