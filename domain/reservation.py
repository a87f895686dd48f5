"""Advance reservations and maintenance windows: pool capacity withheld over a time window.
What each withholds and from whom: docs/architecture.md#the-scheduler.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.errors import InvalidReservation, ReservationDeleted
from domain.resources import PoolId, Resources

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:reservation")
MAX_UNITS = 10_000
MAX_WINDOW_SECONDS = 366 * 86_400


@dataclass(frozen=True)
class Window:
    """A reservation as the scheduler uses it: `count` units of `resources` for `tenant_id`,
    or (no tenant) the whole of `node_ids`, over [start_at, end_at)."""

    reservation_id: str
    pool_id: str
    tenant_id: str | None
    resources: Resources
    count: int
    node_ids: tuple[str, ...]
    start_at: float
    end_at: float

    @property
    def maintenance(self) -> bool:
        return self.tenant_id is None

    def active_at(self, now: float) -> bool:
        return self.start_at <= now < self.end_at

    def in_force_at(self, now: float) -> bool:
        """Active or still to come: what the scheduler must keep free for it."""
        return now < self.end_at

    def usable_by(self, tenant_id: str, resources: Resources, now: float) -> bool:
        """Whether a lease of `tenant_id` asking for `resources` may take one of its units now
        (the window has begun, is the tenant's, and one unit holds the request)."""
        return (self.tenant_id == tenant_id and self.active_at(now)
                and resources.fits_in(self.resources))


@dataclass(frozen=True)
class Withheld:
    """Capacity kept on `node_id` over [start_at, end_at) for reservation `reservation_id`."""

    reservation_id: str
    node_id: str
    start_at: float
    resources: Resources
    end_at: float = float("inf")


@dataclass
class NodeSpace:
    """A candidate node: its allocatable capacity and what it will have free at a time, each
    asked for only when a window gets that far (a pool has many nodes, a window few units)."""

    node_id: str
    allocatable_of: Callable[[], Resources]
    free_at: Callable[[float], Resources]
    ready: bool = True
    _allocatable: Resources | None = field(default=None, repr=False)

    @property
    def allocatable(self) -> Resources:
        if self._allocatable is None:
            self._allocatable = self.allocatable_of()
        return self._allocatable


def problems(*, tenant_id: str | None, resources: Resources, count: int,
             node_ids: Sequence[str], start_at: float, duration_seconds: float,
             now: float) -> list[str]:
    """Every reason the fields do not make a reservation (empty: they do)."""
    found: list[str] = []
    if not 0 < duration_seconds <= MAX_WINDOW_SECONDS:
        found.append(f"duration_seconds must be in (0, {MAX_WINDOW_SECONDS}]")
    elif start_at + duration_seconds <= now:
        found.append("the window has ended already")
    if tenant_id is None:
        if not node_ids:
            found.append("a maintenance window (no tenant) names the nodes it takes")
        if resources != Resources() or count != 1:
            found.append("a maintenance window takes whole nodes, not a shape")
    else:
        if node_ids:
            found.append("a tenant's reservation is a shape and a count, not nodes")
        if not resources.is_non_negative() or resources == Resources():
            found.append("a tenant's reservation needs a non-zero shape")
        if not 1 <= count <= MAX_UNITS:
            found.append(f"count must be in [1, {MAX_UNITS}]")
    if len(set(node_ids)) != len(node_ids):
        found.append("a node is named twice")
    return found


class CapacityReservation(Aggregate):
    """One reservation: created with its window, deleted by the operator."""

    @staticmethod
    def create_id(pool_id: str, reservation_id: str) -> UUID:
        return uuid.uuid5(_NAMESPACE, json.dumps([str(pool_id), str(reservation_id)]))

    @classmethod
    def create(cls, *, reservation_id: str, pool_id: PoolId, tenant_id: str | None,
               resources: Resources, count: int, node_ids: Sequence[str], start_at: float,
               duration_seconds: float, now: float) -> CapacityReservation:
        found = problems(tenant_id=tenant_id, resources=resources, count=count,
                         node_ids=node_ids, start_at=start_at,
                         duration_seconds=duration_seconds, now=now)
        if found:
            raise InvalidReservation("; ".join(found), reasons=found)
        return cls(reservation_id=str(reservation_id), pool_id=str(pool_id),
                   tenant_id=tenant_id, resources=resources.to_dict(), count=int(count),
                   node_ids=list(node_ids), start_at=float(start_at),
                   end_at=float(start_at) + float(duration_seconds), created_at=float(now))

    @event("ReservationCreated")
    def __init__(self, reservation_id: str, pool_id: str, tenant_id: str | None,
                 resources: dict[str, Any], count: int, node_ids: list[str],
                 start_at: float, end_at: float, created_at: float) -> None:
        self.reservation_id = reservation_id
        self.pool_id = PoolId(pool_id)
        self.tenant_id = tenant_id
        self.resources = Resources.from_dict(resources)
        self.count = count
        self.node_ids = tuple(node_ids)
        self.start_at = start_at
        self.end_at = end_at
        self.created_at = created_at
        self.deleted_at: float | None = None
        self.drained_at: float | None = None

    def delete(self, now: float) -> None:
        """Withdraw the reservation: its capacity goes back to everyone at once."""
        if self.deleted_at is not None:
            raise ReservationDeleted(f"reservation {self.reservation_id!r} was deleted")
        self._deleted(at=float(now))

    @event("ReservationDeleted")
    def _deleted(self, at: float) -> None:
        self.deleted_at = at

    def drain_due_at(self, grace_seconds: float) -> float | None:
        """When a maintenance window must notice the leases on its nodes, so that they stop
        by its start with `grace_seconds` to do so; None once done, deleted or not one."""
        if self.tenant_id is not None or self.deleted_at is not None:
            return None
        if getattr(self, "drained_at", None) is not None:
            return None
        return self.start_at - grace_seconds

    def must_leave(self, end_estimate: float | None) -> bool:
        """Whether a lease on its nodes that ends by `end_estimate` would run into it."""
        return end_estimate is None or end_estimate > self.start_at

    def begin_drain(self, now: float) -> None:
        """Record that the leases on the window's nodes were noticed (once: a timer fired
        again after a failover finds this and does nothing)."""
        if self.deleted_at is not None:
            raise ReservationDeleted(f"reservation {self.reservation_id!r} was deleted")
        if self.tenant_id is not None or getattr(self, "drained_at", None) is not None:
            raise InvalidReservation("only a maintenance window is drained, and once",
                                     reasons=("not_drainable",))
        self._drain_started(at=float(now))

    @event("ReservationDrainStarted")
    def _drain_started(self, at: float) -> None:
        self.drained_at = at

    @property
    def window(self) -> Window:
        return Window(self.reservation_id, self.pool_id, self.tenant_id, self.resources,
                      self.count, self.node_ids, self.start_at, self.end_at)

    def same_request(self, *, tenant_id: str | None, resources: Resources, count: int,
                     node_ids: Sequence[str], start_at: float, end_at: float) -> bool:
        """A create repeated with the same fields (a retry), told from a conflicting one."""
        return (self.tenant_id == tenant_id and self.resources == resources
                and self.count == count and self.node_ids == tuple(node_ids)
                and self.start_at == start_at and self.end_at == end_at)

    def status_at(self, now: float) -> str:
        if self.deleted_at is not None:
            return "deleted"
        if now >= self.end_at:
            return "ended"
        return "active" if now >= self.start_at else "upcoming"

    def to_dict(self, now: float) -> dict[str, Any]:
        return {"reservation_id": self.reservation_id, "pool_id": self.pool_id,
                "tenant": self.tenant_id, "resources": self.resources.to_dict(),
                "count": self.count, "node_ids": list(self.node_ids),
                "start_at": self.start_at, "end_at": self.end_at,
                "status": self.status_at(now), "deleted_at": self.deleted_at}


def _scaled(unit: Resources, k: int) -> Resources:
    total = Resources()
    for _ in range(k):
        total = total + unit
    return total


def withhold(windows: Iterable[Window], now: float, nodes: Sequence[NodeSpace],
             used: Mapping[str, int]) -> tuple[list[Withheld], dict[str, int]]:
    """(what to keep free, units short per reservation) at `now`.

    A maintenance window keeps each named node whole from its start. A tenant's reservation
    keeps `count` units less the `used` ones (leases naming it that hold capacity), placed
    first where they fit in what a node will have free at the window's start, then where
    they fit in what is left of its allocatable capacity (the window then waits for leases
    already running there, as no one is drained). Windows are served in start order, each
    node's promises counted against later windows; ended windows withhold nothing."""
    by_id = {n.node_id: n for n in nodes}
    in_order = sorted(nodes, key=lambda n: n.node_id)
    promised: dict[str, Resources] = {}
    out: list[Withheld] = []
    short: dict[str, int] = {}
    for w in sorted(windows, key=lambda w: (w.start_at, w.reservation_id)):
        if not w.in_force_at(now):
            continue
        start = max(w.start_at, now)
        if w.maintenance:
            for nid in w.node_ids:
                node = by_id.get(nid)
                if node is not None:
                    out.append(Withheld(w.reservation_id, nid, start, node.allocatable,
                                        w.end_at))
                    promised[nid] = promised.get(nid, Resources()) + node.allocatable
            continue
        units = max(0, w.count - used.get(w.reservation_id, 0))
        taken: dict[str, int] = {}
        for at_start in (True, False):
            for node in in_order:
                if not units:
                    break
                if not node.ready:
                    continue
                room = node.free_at(start) if at_start else node.allocatable
                left = room - promised.get(node.node_id, Resources())
                while units and w.resources.fits_in(left):
                    left = left - w.resources
                    promised[node.node_id] = (promised.get(node.node_id, Resources())
                                              + w.resources)
                    taken[node.node_id] = taken.get(node.node_id, 0) + 1
                    units -= 1
        for nid, k in sorted(taken.items()):
            out.append(Withheld(w.reservation_id, nid, start, _scaled(w.resources, k),
                                w.end_at))
        if units:
            short[w.reservation_id] = units
    return out, short
