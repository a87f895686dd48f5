"""What the scheduler keeps in memory: queued requests compactly, ended leases not at all."""

from __future__ import annotations

import asyncio
from uuid import UUID

import pytest

from client.api import PoolClient
from domain.lease import Lease
from tests.control_plane import Plane, lease_body, node_body, setup_pool
from workers.pending import QueuedLease
from workers.plane import ControlPlane


def test_waiting_requests_stay_compact_and_placed_ones_become_whole_leases(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=5000))
    with PoolClient(cp.nats_url, "alpha") as alpha:
        ids = [alpha.request_lease(lease_body(f"m{i}"))["lease"]["lease_id"] for i in range(12)]
        report = cp.scheduler.cycle()
        assert report.placed == 5 and report.waiting == 7
        memory = cp.scheduler.aggregates
        held = {lid: memory.peek(UUID(lid)) for lid in ids}
        assert sum(isinstance(a, Lease) and a.state.value == "reserved"
                   for a in held.values()) == 5
        assert sum(isinstance(a, QueuedLease) for a in held.values()) == 7
        waiting = next(lid for lid, a in held.items() if isinstance(a, QueuedLease))
        why = alpha.lease(waiting, "why")["result"]
        assert why["state"] == "queued" and "waiting_for_capacity" in why["reasons"]["tenant"]
        # a second cycle examines the waiting ones again and leaves them compact
        assert cp.scheduler.cycle().placed == 0
        assert sum(isinstance(memory.peek(UUID(lid)), QueuedLease) for lid in ids) == 7


def test_ended_leases_leave_memory_once_settled_and_why_still_answers(plane: Plane) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=2000))
    with PoolClient(cp.nats_url, "alpha") as alpha:
        huge = alpha.request_lease(lease_body("huge", cpu_millis=64_000))["lease"]["lease_id"]
        gone = alpha.request_lease(lease_body("gone"))["lease"]["lease_id"]
        cp.scheduler.cycle()  # rejects `huge` (no node could ever hold it) in its own save
        assert alpha.lease(gone, "cancel", {"reason": "changed my mind"})["ok"]
        placed = alpha.request_lease(lease_body("kept"))["lease"]["lease_id"]
        cp.scheduler.cycle()  # reads the cancel, places `kept`
        memory = cp.scheduler.aggregates
        assert UUID(huge) not in memory and UUID(gone) not in memory
        assert isinstance(memory.peek(UUID(placed)), Lease)
        why = alpha.lease(huge, "why")["result"]
        assert why["state"] == "rejected"
        assert why["reasons"]["filters"]["insufficient_cpu"] == 1
        assert alpha.lease(gone, "why")["result"]["state"] == "cancelled"
    with PoolClient(cp.nats_url, "beta") as beta:  # another tenant learns nothing of it
        assert not beta.lease(huge, "why")["ok"]


def _run_leases(cp: ControlPlane, tenant: PoolClient, n: int, key: str) -> list[str]:
    """`n` leases requested, placed, committed and released (the commit timeout and maximum
    runtime an hour: no deadline passes on the fake clock)."""
    got = tenant.request_lease({**lease_body(key, max_runtime=3600), "count": n})
    assert got["ok"], got
    ids = list(got["result"]["lease_ids"])
    assert cp.scheduler.cycle().placed == n
    for lid in ids:
        assert tenant.lease(lid, "commit", {"job": {"image": "local/job@sha256:" + "a" * 64,
                                                    "command": ["true"]}})["ok"]
        assert tenant.lease(lid, "release", {"exit_code": 0})["ok"]
    cp.scheduler.cycle()  # folds the commits and releases
    return ids


def test_the_deadline_heap_drops_ended_leases_long_before_their_deadlines_pass(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("workers.scheduler.folding.DEADLINES_SLACK", 8, raising=False)
    cp, admin, _clock = plane
    setup_pool(admin, commit_timeout_seconds=3600)
    admin.admin("node.register", node_body("n1", cpu_millis=64_000, memory_mib=65_536))
    with PoolClient(cp.nats_url, "alpha") as a:
        for i in range(4):
            _run_leases(cp, a, 10, f"batch{i}")
        assert a.request_lease(lease_body("still-running", max_runtime=3600))["ok"]
        cp.scheduler.cycle()
        live = [str(k) for k, v in cp.scheduler.aggregates.full.items()
                if type(v).__name__ == "Lease"]
    assert len(live) == 1
    heap = cp.scheduler._deadlines
    # every lease pushed an entry when reserved and one when running: of the fifty that ended
    # (a hundred entries, none due) the heap keeps at most twice the live entries it last
    # counted (a batch of ten in flight: twenty) and the slack
    assert len(heap) <= 2 * 20 + 8, len(heap)
    assert any(lid == live[0] for _due, lid in heap)  # the live lease's deadline is kept


def test_an_ended_lease_leaves_the_schedulers_subject_and_aggregate_caches(
    plane: Plane,
) -> None:
    cp, admin, _clock = plane
    setup_pool(admin)
    admin.admin("node.register", node_body("n1", cpu_millis=64_000, memory_mib=65_536))
    s = cp.scheduler
    with PoolClient(cp.nats_url, "alpha") as a:
        got = a.request_lease({**lease_body("k", max_runtime=3600), "count": 5})
        ids = list(got["result"]["lease_ids"])
        s.cycle()
        for lid in ids:  # as a re-read after a refused batch leaves it
            s.app.repository.get(UUID(lid))
        for lid in ids[:3]:
            assert a.lease(lid, "commit", {"job": {"image": "local/job@sha256:" + "a" * 64,
                                                   "command": ["true"]}})["ok"]
            assert a.lease(lid, "release", {"exit_code": 0})["ok"]
        s.cycle()
    s.app.recorder.runtime.run(asyncio.sleep(0.05))  # the recorder forgets on its own loop
    subjects = s.app.recorder._cache
    cache = s.app.repository.cache
    assert cache is not None
    ended, live = ids[:3], ids[3:]
    assert not any(s.app.recorder.subject_for(lid) in subjects for lid in ended)
    assert all(s.app.recorder.subject_for(lid) in subjects for lid in live)
    assert not any(UUID(lid) in cache.cache for lid in ended)
    assert all(UUID(lid) in cache.cache for lid in live)
