"""The priority audit: no placement passed over a waiting request of a higher priority class
(beyond what aging allows) that could have taken its place, from the same records as fair share.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from projections.fair_share import (
    Configured,
    Funds,
    Left,
    Placed,
    Record,
    Requested,
)


@dataclass
class PriorityReport:
    """Placements made while a request of another class waited, and those that passed over a
    higher one."""

    placements: int = 0  # placements judged (a request of another class waited alongside)
    violations: list[str] = field(default_factory=list)


def check_priority(records: Iterable[Record], *, lag_seconds: float,
                   holds: Mapping[str, int] | None = None,
                   exempt: set[str] | None = None,
                   seqs: range | None = None) -> PriorityReport:
    """Fold one pool's records in log order. At each placement, no other request may have
    waited (since at least `lag_seconds` before it, able to pay its hold all that while) with
    the same shape, so that it fitted wherever the placed one did — backfill cannot be why —
    in a priority class ranked above the placed lease's rank as aging had raised it.

    Lenient where the scheduler could have seen otherwise: the placed lease's rank is taken as
    high as aging could have made it (uncapped), the waiting one's as its class's own. Gang
    members and leases bound to an advance reservation (`exempt`) neither judge nor are judged:
    their waits are their gang's or their reservation's. `seqs`: judge only the placements at
    these events of the log."""
    report = PriorityReport()
    ranks: dict[str, int] = {}
    aging = 0.0
    waiting: dict[str, Requested] = {}
    funds: dict[str, deque[tuple[float, int]]] = {}
    holds = holds or {}
    exempt = exempt or set()

    def rank(req: Requested, at: float, *, aged: bool) -> int | None:
        base = ranks.get(req.priority_class)
        if base is None or not aged or aging <= 0:
            return base
        return base + math.floor(max(at - req.at, 0.0) / aging)

    def afforded(req: Requested, since: float) -> bool:
        q = funds.get(req.tenant)
        if not q:
            return True
        while len(q) > 1 and q[1][0] <= since:
            q.popleft()
        return min(a for _, a in q) >= holds.get(req.lease_id, 0)

    for rec in records:
        if isinstance(rec, Configured):
            ranks, aging = dict(rec.ranks), rec.aging_seconds_per_rank
        elif isinstance(rec, Funds):
            funds.setdefault(rec.tenant, deque()).append((rec.at, rec.available))
        elif isinstance(rec, Requested):
            if rec.lease_id not in exempt:
                waiting[rec.lease_id] = rec
        elif isinstance(rec, Left):
            waiting.pop(rec.lease_id, None)
        elif isinstance(rec, Placed):
            placed = waiting.pop(rec.lease_id, None)
            if placed is None or (seqs is not None and rec.seq not in seqs):
                continue
            mine = rank(placed, rec.at, aged=True)
            since = rec.at - lag_seconds
            rivals = [w for w in waiting.values() if w.priority_class != placed.priority_class]
            if mine is None or not rivals:
                continue
            report.placements += 1
            for w in rivals:
                theirs = rank(w, rec.at, aged=False)
                if (theirs is not None and theirs > mine and w.shape_key == placed.shape_key
                        and w.at <= since and afforded(w, since)):
                    report.violations.append(
                        f"{rec.lease_id} ({placed.tenant}, class {placed.priority_class}, rank "
                        f"{mine} aged) placed at {rec.at:.3f} while {w.lease_id} ({w.tenant}, "
                        f"class {w.priority_class}, rank {theirs}) of the same shape waited "
                        f"since {w.at:.3f}")
                    break
    return report
