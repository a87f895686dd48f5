"""The scheduler's advance reservations and maintenance windows, folded from the log.
What each cycle keeps free: docs/architecture.md#advance-reservations-and-maintenance-windows.
"""

from __future__ import annotations

import functools
from typing import Any

from domain.lease import Lease
from domain.policy.backfill import Backfill
from domain.policy.placement import NodeTable
from domain.reservation import CapacityReservation, NodeSpace, withhold
from domain.resources import Resources


def _allocatable(table: NodeTable, node_id: str) -> Resources:
    return table.allocated_resources(node_id) + table.free_resources(node_id)


class Windows:
    """Reservations in force by pool, and the capacity-holding leases that name each."""

    def __init__(self) -> None:
        self._by_pool: dict[str, dict[str, CapacityReservation]] = {}
        self._holding: dict[tuple[str, str], set[str]] = {}
        # pool → reservation → units it could not be given this cycle (the pool is too full)
        self.short: dict[str, dict[str, int]] = {}

    def index(self, r: CapacityReservation) -> None:
        """A reservation was created or deleted."""
        pool = self._by_pool.setdefault(r.pool_id, {})
        if r.deleted_at is None:
            pool[r.reservation_id] = r
        else:
            pool.pop(r.reservation_id, None)

    def track(self, lease: Lease) -> None:
        """A lease changed: if it names a reservation, whether it holds one of its units."""
        rid = getattr(lease, "advance_reservation_id", None)
        if rid is None:
            return
        key = (lease.pool_id, rid)
        lid = str(lease.id)
        if lease.holds_capacity:
            self._holding.setdefault(key, set()).add(lid)
        elif key in self._holding:
            self._holding[key].discard(lid)
            if not self._holding[key]:
                del self._holding[key]

    def in_force(self, pool_id: str) -> bool:
        return bool(self._by_pool.get(pool_id))

    def apply(self, pool_id: str, bf: Backfill, now: float) -> None:
        """Give this cycle's backfill what the pool's windows keep free at `now`; windows that
        have ended are forgotten."""
        wins = self._by_pool.get(pool_id)
        if wins:
            for rid in [rid for rid, r in wins.items() if r.end_at <= now]:
                del wins[rid]
        if not wins:
            bf.withhold(())
            self.short.pop(pool_id, None)
            return
        table = bf.table
        nodes = [NodeSpace(nid, functools.partial(_allocatable, table, nid),
                           functools.partial(bf.capacity_at, nid),
                           ready=table.state_of(nid) == "ready")
                 for nid in table.node_ids]
        used = {rid: len(self._holding.get((pool_id, rid), ())) for rid in wins}
        withheld, short = withhold([r.window for r in wins.values()], now, nodes, used)
        bf.withhold(withheld)
        self.short[pool_id] = short

    def explain(self, pool_id: str, why: dict[str, Any]) -> None:
        """Name the pool's windows in force in a held-back request's reasons."""
        wins = self._by_pool.get(pool_id)
        if wins:
            why["windows"] = sorted(wins)

    def usable(self, pool_id: str, lease: Any, now: float) -> str | None:
        """The reservation `lease` (a Lease or its compact record) may use now: its own, open,
        the lease fits one unit and a unit is free; else None (it competes as any other)."""
        rid = getattr(lease, "advance_reservation_id", None)
        if rid is None:
            return None
        r = self._by_pool.get(pool_id, {}).get(rid)
        if r is None or not r.window.usable_by(lease.tenant_id,
                                               lease.requested_shape.resources, now):
            return None
        if len(self._holding.get((pool_id, rid), ())) >= r.count:
            return None
        return str(rid)
