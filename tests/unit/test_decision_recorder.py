"""The decision recorder alone: records on change only, bounded a cycle, and `reason_at`."""

from __future__ import annotations

import json

from workers.scheduler.decisions import DecisionRecorder, reason_at

CAPACITY = {"tenant": ["waiting_for_capacity"], "filters": {"cpu": 3}}


class _Writer:
    def __init__(self) -> None:
        self.batches: list[list[tuple[str, str, bytes]]] = []

    def append(self, records: list[tuple[str, str, bytes]]) -> None:
        self.batches.append(list(records))


def test_a_moved_position_alone_is_not_recorded_again() -> None:
    w = _Writer()
    r = DecisionRecorder(w)
    r.waiting("p1", "alpha", "l1", {**CAPACITY, "queue": {"position": 3}}, 10.0)
    assert r.flush() == 1
    r.waiting("p1", "alpha", "l1", {**CAPACITY, "queue": {"position": 2}}, 11.0)
    assert r.flush() == 0
    r.waiting("p1", "alpha", "l1", {**CAPACITY, "filters": {"cpu": 2}}, 12.0)
    assert r.flush() == 1 and len(w.batches) == 2


def test_a_change_not_yet_written_is_replaced_by_the_newer_one() -> None:
    w = _Writer()
    r = DecisionRecorder(w, max_per_cycle=1)
    r.waiting("p1", "alpha", "l0", CAPACITY, 1.0)
    r.waiting("p1", "alpha", "l1", CAPACITY, 1.0)
    r.waiting("p1", "alpha", "l1", {"tenant": ["quota_exceeded"]}, 2.0)
    assert r.pending == 2 and r.flush() == 1 and r.flush() == 1 and r.flush() == 0
    assert json.loads(w.batches[1][0][2])["reasons"] == {"tenant": ["quota_exceeded"]}


def test_reason_at_picks_the_last_record_at_or_before_the_time() -> None:
    def rec(at: float, state: str = "waiting", **reasons: object) -> bytes:
        return json.dumps({"at": at, "state": state, "reasons": reasons}).encode()

    records = [rec(30.0, "reserved"), rec(10.0, tenant=["a"]), rec(20.0, tenant=["b"])]
    lease = {"requested_at": 5.0, "ended_at": None}
    assert reason_at(records, 4.0, lease)["state"] == "not_requested"
    assert reason_at(records, 7.0, lease)["state"] == "not_yet_examined"
    assert reason_at(records, 10.0, lease)["reasons"] == {"tenant": ["a"]}
    assert reason_at(records, 29.9, lease)["reasons"] == {"tenant": ["b"]}
    assert not reason_at(records, 31.0, lease)["waiting"]
    assert reason_at(records, 99.0, {**lease, "ended_at": 50.0})["state"] == "ended"
    placed_at_once = reason_at([], 9.0, {**lease, "reserved_at": 8.0})
    assert placed_at_once["state"] == "reserved" and not placed_at_once["waiting"]


def test_a_lease_placed_at_its_first_look_writes_no_record() -> None:
    w = _Writer()
    r = DecisionRecorder(w)
    r.left("p1", "alpha", "l1", "reserved", 1.0, node_id="n1")
    r.waiting("p1", "alpha", "l2", CAPACITY, 1.0)
    r.left("p1", "alpha", "l2", "reserved", 2.0, node_id="n1")
    assert r.flush() == 2 and [lid for _t, lid, _b in w.batches[0]] == ["l2", "l2"]
