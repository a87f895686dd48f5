"""Preemption policy: which running leases to stop so a waiting request fits, losing least work.
Callers pass only nodes that could hold the request when empty (`FilterResult.busy`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from domain.resources import Resources, Shape

if TYPE_CHECKING:
    from domain.pool import Pool, TenantPolicy

# why a victim was noticed: a higher class or fair share ("preempted"), or an owner taking
# back nominal quota its cohort lent ("reclaiming_quota")
PREEMPTED = "preempted"
RECLAIMING_QUOTA = "reclaiming_quota"


def lease_preemptible(pool: Pool, policy: TenantPolicy | None, priority_class: str) -> bool:
    """Whether a lease may ever be a victim: neither its tenant nor its priority class says
    it is not preemptible."""
    tenant_ok = policy is None or getattr(policy, "preemptible", True)
    return tenant_ok and pool.config.class_preemptible(priority_class)


@dataclass(frozen=True)
class RunningLease:
    lease_id: str
    tenant: str
    priority_rank: int
    resources: Resources
    started_at: float
    last_checkpoint_at: float | None = None
    checkpointable: bool = False

    def work_lost(self, now: float) -> float:
        """Seconds of work redone if stopped now: since the last checkpoint if it has one."""
        since = self.started_at
        if self.checkpointable and self.last_checkpoint_at is not None:
            since = max(self.last_checkpoint_at, self.started_at)
        return max(now - since, 0.0)


@dataclass(frozen=True)
class NodeCandidate:
    """A node the request could run on if enough leases were stopped."""

    node_id: str
    free: Resources  # free capacity now
    leases: tuple[RunningLease, ...]


@dataclass(frozen=True)
class PreemptionPlan:
    node_id: str
    victims: tuple[RunningLease, ...]  # in the order they were chosen (least work lost first)
    work_lost_seconds: float  # sum over victims

    @property
    def victim_ids(self) -> tuple[str, ...]:
        return tuple(v.lease_id for v in self.victims)


def is_preemptible(
    lease: RunningLease,
    requester_rank: int,
    tenants_over_fair_share: Iterable[str] | set[str],
    min_runtime_seconds: float,
    now: float,
    requester_tenant: str | None = None,
) -> bool:
    """Lower priority, or same priority and the lease's tenant is above its fair share; and
    it has run at least `min_runtime_seconds` (so nothing is preempted before it can progress).

    Fair-share preemption never reaches a higher class, nor the requester's own tenant (that
    would trade one of its leases for another).
    """
    if now - lease.started_at < min_runtime_seconds:
        return False
    if lease.priority_rank < requester_rank:
        return True
    over = tenants_over_fair_share if isinstance(tenants_over_fair_share, set) else set(
        tenants_over_fair_share
    )
    return (
        lease.priority_rank == requester_rank
        and lease.tenant in over
        and lease.tenant != requester_tenant
    )


def _plan_for_node(
    request: Resources, node: NodeCandidate, victims: list[RunningLease], now: float
) -> PreemptionPlan | None:
    dims = sorted(
        set(request.dimensions()) | {d for v in victims for d in v.resources.dimensions()}
    )
    need = np.array([request.get(d) - node.free.get(d) for d in dims], dtype=np.int64)
    if (need <= 0).all():
        return PreemptionPlan(node.node_id, (), 0.0)
    if not victims:
        return None
    # Greedy by least work lost; ties go to the lease that covers more of what is missing
    # (fewer victims), then to the lease id so plans are deterministic.
    raw = np.array([[v.resources.get(d) for d in dims] for v in victims], dtype=np.int64)
    short = need > 0
    useful = (np.minimum(raw[:, short], need[short]) / need[short]).sum(axis=1)
    order = sorted(
        range(len(victims)),
        key=lambda j: (victims[j].work_lost(now), -useful[j], victims[j].lease_id),
    )
    victims = [victims[j] for j in order]
    amounts = raw[order]
    enough = (np.cumsum(amounts, axis=0) >= need).all(axis=1)
    if not enough.any():
        return None
    k = int(np.argmax(enough)) + 1
    chosen = list(range(k))
    # Make the set minimal: drop any chosen victim (most work lost first) not actually needed.
    total = amounts[:k].sum(axis=0)
    for j in sorted(chosen, key=lambda j: -victims[j].work_lost(now)):
        if ((total - amounts[j]) >= need).all():
            total = total - amounts[j]
            chosen.remove(j)
    picked = tuple(victims[j] for j in chosen)
    return PreemptionPlan(node.node_id, picked, float(sum(v.work_lost(now) for v in picked)))


def choose_victims(
    request_shape: Shape,
    candidates: Sequence[NodeCandidate],
    requester_rank: int,
    tenants_over_fair_share: Iterable[str],
    min_runtime_seconds: float,
    now: float,
    *,
    requester_tenant: str | None = None,
) -> PreemptionPlan | None:
    """The cheapest way to make room: per node a minimal victim set, greedy by least work lost;
    then the node whose plan loses the least total work (ties: fewer victims, then node id).

    None when no candidate can be freed enough by preemptible leases alone.
    """
    over = set(tenants_over_fair_share)
    best: PreemptionPlan | None = None
    best_key: tuple[float, int, str] | None = None
    for node in candidates:
        victims = [
            v for v in node.leases
            if is_preemptible(v, requester_rank, over, min_runtime_seconds, now, requester_tenant)
        ]
        plan = _plan_for_node(request_shape.resources, node, victims, now)
        if plan is None:
            continue
        key = (plan.work_lost_seconds, len(plan.victims), plan.node_id)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    return best
