"""A plan, what the planner plans on, and the helpers its parts share (the planner itself:
workers.scheduler.planner)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from uuid import UUID

from eventsourcing.domain import Aggregate

from domain.account import Account
from domain.devices import wanted
from domain.lease import Lease
from domain.node import Node
from domain.policy.backfill import LeaseEnd
from domain.pool import Pool
from domain.resources import LeaseId, Shape
from domain.topology import topology_of
from workers.pending import LeaseMemory, QueuedLease
from workers.reservations import Windows
from workers.scheduler.state import PendingPreemption, Placed, PoolState, account_uuid, node_uuid

if TYPE_CHECKING:
    from workers.scheduler.decisions import DecisionRecorder


class Settings(Protocol):
    """The planner's settings and its cycle's budget, as a pass reads them."""

    backfill: bool
    max_examined_per_cycle: int
    estimate_starts: bool
    stop_when_nothing_fits: bool
    plans_left: int


class PlanState(Protocol):
    """What the planner reads and updates: the scheduler's fold (workers.scheduler.folding),
    or any state built in memory the same way."""

    aggregates: LeaseMemory
    pools: dict[str, PoolState]
    reasons: dict[str, dict[str, Any]]
    decisions: DecisionRecorder | None
    deadlines: list[tuple[float, str]]
    usage: dict[str, tuple[str, Any]]
    array_holding: dict[str, set[str]]
    preempting_for: dict[str, PendingPreemption]
    windows: Windows

    def track(self, ps: PoolState, lease: Lease) -> None: ...

    def throttled(self, array: str, lease: Lease | QueuedLease) -> dict[str, Any] | None: ...

    def lease_end(self, lease_id: str) -> LeaseEnd | None: ...


@dataclass
class Plan:
    """One atomic batch's worth of a pool's decisions. `aggregates` are the leases whose new
    events say them (reserved, rejected, noticed); `allocations` and `holds` are recorded as
    one event per node and per account when the plan is saved."""

    pool_id: str
    aggregates: list[Aggregate] = field(default_factory=list)
    # node id → its placements of this plan: (lease, amount, GPU devices)
    allocations: dict[str, list[Placed]] = field(default_factory=dict)
    # tenant → its credit holds of this plan: (transfer id, lease, amount) each, and their sum
    holds: dict[str, list[tuple[str, LeaseId, int]]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    reserved: list[Lease] = field(default_factory=list)  # in the order they were placed
    rejected: list[str] = field(default_factory=list)  # lease ids
    reasons: dict[str, dict[str, Any]] = field(default_factory=dict)  # waits and rejections
    preempted: int = 0  # victims noticed
    # compact leases promoted for this plan: (version, log sequence) of their last event, so
    # the save need not look up where their subjects end
    ends: dict[UUID, tuple[int, int]] = field(default_factory=dict)

    @property
    def messages(self) -> int:
        """The events its save writes: one per lease event, node and account."""
        return len(self.aggregates) + len(self.allocations) + len(self.holds)

    def reservations(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """(lease, node, devices) of each placement, in order."""
        return [(str(lease.id), str(lease.node_id), tuple(lease.devices or ()))
                for lease in self.reserved]


# helpers the pass and its gang and preemption parts share ---------------------------------


def whole(state: PlanState, plan: Plan, lease: Lease | QueuedLease) -> Lease:
    """The Lease itself, rebuilt from its compact record if it is one (to record events)."""
    if isinstance(lease, QueuedLease):
        if lease.end:  # where its subject ends, for the save
            plan.ends[lease.id] = (lease.version, lease.end)
        got = state.aggregates.promote(lease.id)
        assert isinstance(got, Lease)
        return got
    return lease


def hold_and_available(state: PlanState, plan: Plan, pool: Pool, tenant: str,
                       lease: Lease | QueuedLease) -> tuple[int, int]:
    """The credit hold the lease needs in this pool, and what its tenant has available."""
    hold = pool.hold_for(lease.requested_shape, lease.maximum_runtime_seconds)
    acc = state.aggregates.get(account_uuid(tenant))
    if not isinstance(acc, Account):
        return hold, 0
    return hold, acc.available - plan.held.get(tenant, 0)  # less this plan's holds


def devices_for(state: PlanState, plan: Plan, node_id: str, shape: Shape
                ) -> tuple[str, ...] | None:
    """The node's GPU devices for this placement (domain.devices), past those of this plan's
    placements on it not yet recorded; () when it binds none, None when too few are free."""
    if wanted(shape)[1] <= 0:  # () whatever the node lists: no look-up a placement
        return ()
    node = state.aggregates.get(node_uuid(node_id))
    if not isinstance(node, Node) or not node.capabilities.devices:
        return ()
    pending = [d for item in plan.allocations.get(node_id, ()) for d in item[2]]
    return node.choose_devices(shape, pending)


def add_hold(plan: Plan, tenant: str, lid: LeaseId, epoch: int, hold: int) -> None:
    """A credit hold of the plan, recorded with the tenant's others as one account event."""
    holds = plan.holds.get(tenant)
    if holds is None:
        holds = plan.holds[tenant] = []
    holds.append((f"hold-{lid}-{epoch}", lid, hold))
    plan.held[tenant] = plan.held.get(tenant, 0) + hold


def topology(state: PlanState) -> Callable[[str], dict[str, str]]:
    """A node's topology labels, by node id ({} for a node not held)."""
    def labels(node_id: str) -> dict[str, str]:
        node = state.aggregates.get(node_uuid(node_id))
        return topology_of(node.capabilities) if isinstance(node, Node) else {}
    return labels
