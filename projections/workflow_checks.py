"""The log's workflow decisions audited from the log alone: an array never had more than its
`max_running` leases holding capacity at once, and no lease was reserved before the leases it
waits for ended as it asked (`pool audit decisions`, the fault suite and the tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from projections.replay import event_name, notifications, state_of

# the events after which a lease no longer holds the capacity its LeaseReserved took
_CAPACITY_GIVEN_BACK = frozenset({"LeaseReleased", "LeaseCancelled", "ReservationVoided",
                                  "LeasePreempted", "LeaseRetried", "LeaseRequeued"})
# the events that end a lease, and the end reason each carries (or is)
_ENDED = frozenset({"LeaseReleased", "LeaseCancelled", "ReservationVoided", "LeasePreempted",
                    "LeaseRejected"})


@dataclass
class WorkflowReport:
    """Arrays throttled and their peak; dependent placements checked; every breach."""

    arrays: int = 0
    peak: dict[str, int] = field(default_factory=dict)  # array → most holding at once
    over_throttle: list[str] = field(default_factory=list)
    dependents_placed: int = 0
    early_starts: list[str] = field(default_factory=list)


def _end_reason(name: str, fields: dict[str, Any]) -> str:
    if name == "LeaseReleased":
        return str(fields.get("reason") or "released")
    if name == "LeaseRejected":
        return str(fields.get("code") or "rejected")
    return {"LeaseCancelled": "cancelled", "ReservationVoided": "commit_timeout",
            "LeasePreempted": "preempted"}[name]


def _met(condition: str, end_reason: str | None) -> bool:
    if end_reason is None:
        return False
    return condition == "any" or (end_reason == "succeeded") == (condition == "ok")


def check_workflows(app: Any, seqs: range | None = None) -> WorkflowReport:
    """Fold the whole log: after every event, each array's leases holding capacity (from
    their LeaseReserved until capacity is given back) are at most its max_running; at every
    LeaseReserved of a lease that waits for others, each of them has ended as it asked.
    `seqs`: judge only at these events (the state before them still folded)."""
    report = WorkflowReport()
    array_of: dict[UUID, tuple[str, int]] = {}
    holding: dict[str, set[UUID]] = {}
    after: dict[UUID, list[tuple[str, str]]] = {}
    ended: dict[str, str] = {}  # lease id → its end reason
    for n in notifications(app):
        if seqs is not None and n.id >= seqs.stop:
            break
        name = event_name(n.topic)
        oid = n.originator_id
        judged = seqs is None or n.id in seqs
        if name == "LeaseRequested":
            fields = state_of(n).get("workflow") or {}
            if fields.get("array_id") and fields.get("max_running"):
                array = str(fields["array_id"])
                if array not in holding:
                    holding[array] = set()
                    report.arrays += 1
                array_of[oid] = (array, int(fields["max_running"]))
            if fields.get("after"):
                after[oid] = [(str(d[0]), str(d[1])) for d in fields["after"]]
            continue
        if name in _ENDED:
            ended[str(oid)] = _end_reason(name, state_of(n))
        if name == "LeaseReserved" and judged:
            deps = after.get(oid)
            if deps is not None:
                report.dependents_placed += 1
                for lease_id, condition in deps:
                    if not _met(condition, ended.get(lease_id)):
                        report.early_starts.append(
                            f"lease {oid} reserved at {n.id} before lease {lease_id} ended "
                            f"{condition} (it had {ended.get(lease_id) or 'not ended'})")
        member = array_of.get(oid)
        if member is None:
            continue
        array, limit = member
        if name == "LeaseReserved":
            holding[array].add(oid)
            count = len(holding[array])
            report.peak[array] = max(report.peak.get(array, 0), count)
            if count > limit and judged:
                report.over_throttle.append(
                    f"array {array}: {count} leases hold capacity at {n.id}, its max_running "
                    f"is {limit}")
        elif name in _CAPACITY_GIVEN_BACK:
            holding[array].discard(oid)
    return report
