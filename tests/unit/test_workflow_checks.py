"""The workflow replay checks catch what they are for: an array past its max_running, and a
lease reserved before the lease it waits for ended as it asked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

from projections.workflow_checks import check_workflows


@dataclass
class _Note:
    id: int
    originator_id: UUID
    topic: str
    state: str


class _Log:
    """Just enough of an application for the replay: a recorder with the notifications."""

    def __init__(self, events: list[tuple[UUID, str, dict[str, Any]]]) -> None:
        self.notes = [_Note(i, oid, f"domain.lease:Lease.{name}", json.dumps(fields))
                      for i, (oid, name, fields) in enumerate(events, start=1)]
        self.recorder = self

    def select_notifications(self, start: int, limit: int) -> list[_Note]:
        return self.notes[start - 1:start - 1 + limit]


def test_an_array_past_its_max_running_is_caught() -> None:
    a, b, c = uuid4(), uuid4(), uuid4()
    array = {"workflow": {"array_id": str(a), "max_running": 2}}
    log = _Log([(a, "LeaseRequested", array), (b, "LeaseRequested", array),
                (c, "LeaseRequested", array), (a, "LeaseReserved", {}),
                (b, "LeaseReserved", {}), (a, "LeaseRetried", {}), (c, "LeaseReserved", {}),
                (b, "LeaseReleased", {"reason": "failed"}), (a, "LeaseReserved", {}),
                (b, "LeaseReserved", {})])
    report = check_workflows(log)
    assert report.arrays == 1 and report.peak == {str(a): 3}
    assert len(report.over_throttle) == 1 and "3 leases" in report.over_throttle[0]


def test_a_lease_reserved_before_its_dependency_ended_as_asked_is_caught() -> None:
    first, ok, notok = uuid4(), uuid4(), uuid4()
    log = _Log([(first, "LeaseRequested", {}),
                (ok, "LeaseRequested", {"workflow": {"after": [[str(first), "ok"]]}}),
                (notok, "LeaseRequested", {"workflow": {"after": [[str(first), "notok"]]}}),
                (notok, "LeaseReserved", {}),  # too early: first has not ended
                (first, "LeaseReleased", {"reason": "succeeded"}),
                (ok, "LeaseReserved", {})])
    report = check_workflows(log)
    assert report.dependents_placed == 2
    assert len(report.early_starts) == 1 and str(notok) in report.early_starts[0]
