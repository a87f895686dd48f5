"""Checks that fold the whole event log: placements against node capacity, effects per key.

The fault suite (chaos/suite.py) and the scheduler tests judge runs with these, from the log
alone; nothing here trusts a process's memory.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from domain.resources import Resources

PAGE = 5000


def notifications(app: Any, start: int = 1, *, page: int = PAGE) -> Iterator[Any]:
    """Every notification of `app`'s log from `start`, fetched a page at a time."""
    while True:
        batch = app.recorder.select_notifications(start, page)
        if not batch:
            return
        yield from batch
        start = batch[-1].id + 1


def event_name(topic: str) -> str:
    """`domain.lease:Lease.LeaseReserved` → `LeaseReserved`."""
    return topic.rsplit(".", 1)[-1]


def state_of(notification: Any) -> dict[str, Any]:
    """The event's recorded fields, without building the domain object (fast for big logs)."""
    out: dict[str, Any] = json.loads(notification.state)
    return out


@dataclass
class PlacementReport:
    """What a replay of node capacity found: overcommits and leases held twice at once."""

    placements: int = 0
    over_allocations: list[str] = field(default_factory=list)
    double_holds: list[str] = field(default_factory=list)

    @property
    def double_placements(self) -> int:
        return len(self.over_allocations) + len(self.double_holds)


def check_placements(app: Any) -> PlacementReport:
    """Fold the whole log: at every event, each node's leases must fit in its allocatable, and
    no lease may hold capacity on two nodes (or twice on one) at the same time."""
    report = PlacementReport()
    allocatable: dict[UUID, Resources] = {}
    held: dict[UUID, dict[str, Resources]] = defaultdict(dict)
    holder: dict[str, UUID] = {}
    for n in notifications(app):
        name = event_name(n.topic)
        if name in ("NodeRegistered", "NodeReregistered"):
            ev = app.mapper.to_domain_event(n)
            allocatable[ev.originator_id] = Resources.from_dict(ev.capabilities["allocatable"])
        elif name in ("CapacityAllocated", "CapacityAllocatedBatch"):
            ev = app.mapper.to_domain_event(n)
            node = ev.originator_id
            # one lease, or several placed on the node in one scheduler batch: each in turn
            items = ([(ev.lease_id, ev.resources)] if name == "CapacityAllocated"
                     else ev.allocations)
            for lease_id, resources in items:
                lease = str(lease_id)
                report.placements += 1
                if lease in holder:
                    report.double_holds.append(
                        f"lease {lease} allocated on node {node} at {n.id} while held on "
                        f"node {holder[lease]}")
                holder[lease] = node
                held[node][lease] = Resources.from_dict(resources)
                total = sum(held[node].values(), Resources())
                if node not in allocatable or not total.fits_in(allocatable[node]):
                    report.over_allocations.append(f"node {node} over-allocated at {n.id}")
        elif name == "CapacityFreed":
            ev = app.mapper.to_domain_event(n)
            lease = str(ev.lease_id)
            held[ev.originator_id].pop(lease, None)
            if holder.get(lease) == ev.originator_id:
                del holder[lease]
    return report


def count_events(app: Any, names: set[str], key: str | None = None,
                 start: int = 1) -> Counter[Any]:
    """How many events of the given names the log holds, per `key` field (or per originator)."""
    out: Counter[Any] = Counter()
    for n in notifications(app, start):
        name = event_name(n.topic)
        if name not in names:
            continue
        if key is None:
            out[(name, str(n.originator_id))] += 1
        else:
            out[(name, str(state_of(n).get(key)))] += 1
    return out
