"""A node's heartbeat is answered on the bus's loop once its node and leases are cached, its
reads awaited there; anything else (a cold cache, a refused save) is answered on a thread."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest

from bus.local.server import NatsServer
from bus.replies import node_inbox
from client.api import PoolClient
from domain.node import Node
from projections.decisions import count_events
from tests.control_plane import (
    FakeClock,
    lease_body,
    node_body,
    setup_pool,
    start,
    threaded_subjects,
)
from workers.plane import ControlPlane

Plane = tuple[ControlPlane, PoolClient, PoolClient, FakeClock, list[str]]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    threaded = threaded_subjects(cp)
    admin = PoolClient(fresh_nats.url)
    setup_pool(admin, tenants={"alpha": 1.0})
    assert admin.admin("node.register", node_body("n1"))["ok"]
    alpha = PoolClient(fresh_nats.url, "alpha")
    agent = PoolClient(fresh_nats.url, inbox_prefix=node_inbox("n1").encode())
    yield cp, alpha, agent, clock, threaded
    agent.close()
    alpha.close()
    admin.close()
    cp.stop()


def _beat(agent: PoolClient, seq: int, *leases: tuple[str, int]) -> dict[str, Any]:
    r = agent.call("pool.node.n1.heartbeat", {
        "node_id": "n1", "seq": seq,
        "leases": [{"lease_id": lid, "epoch": epoch} for lid, epoch in leases]})
    assert r["ok"], r
    return r["result"]  # type: ignore[no-any-return]


def _on_threads(threaded: list[str]) -> int:
    return sum(1 for s in threaded if s.endswith(".heartbeat"))


def _recorded(cp: ControlPlane, name: str) -> int:
    return sum(count_events(cp.app, {name}).values())


def _running(cp: ControlPlane, alpha: PoolClient, key: str) -> str:
    lid: str = alpha.request_lease(lease_body(key))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 1
    assert alpha.lease(lid, "commit", {})["ok"]
    return lid


def test_a_cached_nodes_beat_and_its_leases_are_answered_on_the_loop(plane: Plane) -> None:
    cp, alpha, agent, clock, threaded = plane
    lid = _running(cp, alpha, "run")
    for uid in (Node.create_id("n1"), UUID(lid)):  # nothing cached
        cp.app.repository.cache.get(uid, evict=True)  # type: ignore[union-attr]
    first = _beat(agent, 1, (lid, 1))
    assert first["leases"][lid]["live"] is True
    assert _on_threads(threaded) == 1  # nothing cached: read on a thread, which caches
    beats, node_beats = _recorded(cp, "HeartbeatRecorded"), _recorded(cp, "NodeHeartbeatRecorded")
    clock.advance(10)  # past a quarter of both timeouts (30 s): news for the lease and the node
    second = _beat(agent, 2, (lid, 1))
    assert second["node_state"] == "ready"
    assert second["leases"][lid] == {"live": True, "state": "running",
                                     "deadline": alpha.lease(lid, "get")["lease"]["deadline"]}
    assert _on_threads(threaded) == 1  # answered on the loop
    assert _recorded(cp, "HeartbeatRecorded") == beats + 1
    assert _recorded(cp, "NodeHeartbeatRecorded") == node_beats + 1
    # a lease from an older placement is fenced on the loop as on a thread
    fenced = _beat(agent, 3, (lid, 7))
    assert fenced["leases"][lid]["live"] is False
    assert fenced["leases"][lid]["code"] == "stale_epoch"
    assert _on_threads(threaded) == 1


def test_a_node_the_scheduler_changed_is_read_to_its_end_on_the_loop(plane: Plane) -> None:
    cp, alpha, agent, clock, threaded = plane
    _beat(agent, 1)
    # the scheduler places a lease on n1 (a write to the node the command service's copy has
    # not seen); it waits for its commit, so the beat passes it over, by its last event
    lid = alpha.request_lease(lease_body("held"))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 1
    node_beats, on_threads = _recorded(cp, "NodeHeartbeatRecorded"), _on_threads(threaded)
    clock.advance(10)
    got = _beat(agent, 2)
    assert got == {"node_state": "ready", "leases": {}}
    assert _recorded(cp, "NodeHeartbeatRecorded") == node_beats + 1  # saved past the write
    assert _on_threads(threaded) == on_threads
    assert alpha.lease(lid, "get")["lease"]["state"] == "reserved"


def test_a_beat_refused_on_the_loop_is_answered_once_on_a_thread(plane: Plane) -> None:
    """A write to the node lands between the beat's read and its save on the loop: the save
    is refused, the thread path runs the beat again, and it is recorded once."""
    cp, _alpha, agent, clock, threaded = plane
    _beat(agent, 1)
    recorder: Any = cp.app.recorder
    insert = recorder.insert_async
    cordoned: list[bool] = []

    async def cordon_first(stored: Any) -> list[int]:
        if not cordoned:
            cordoned.append(True)
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: cp.app.node_state("n1", "cordon", "maintenance"))
        return await insert(stored)  # type: ignore[no-any-return]

    recorder.insert_async = cordon_first
    node_beats, on_threads = _recorded(cp, "NodeHeartbeatRecorded"), _on_threads(threaded)
    clock.advance(10)
    got = _beat(agent, 2)
    assert cordoned and got["node_state"] == "cordoned"
    assert _on_threads(threaded) == on_threads + 1  # refused on the loop: answered on a thread
    assert _recorded(cp, "NodeHeartbeatRecorded") == node_beats + 1


def test_an_expired_lease_the_agent_no_longer_runs_is_reconciled_on_the_loop(
        plane: Plane) -> None:
    cp, alpha, agent, clock, threaded = plane
    lid = _running(cp, alpha, "gone")
    _beat(agent, 1, (lid, 1))
    clock.advance(31)  # heartbeat timeout 30 s
    assert cp.scheduler.cycle().expired == 1
    assert alpha.lease(lid, "get")["lease"]["state"] == "reconciling"
    on_threads = _on_threads(threaded)
    got = _beat(agent, 2)  # the workload is gone: the agent lists nothing
    assert got["leases"][lid]["code"] == "reconciled"
    assert _on_threads(threaded) == on_threads
    assert _recorded(cp, "LeaseReleased") == 1  # once: the next beat finds nothing to do
    assert alpha.lease(lid, "get")["lease"]["state"] == "released"
    again = _beat(agent, 3)
    assert again == {"node_state": "ready", "leases": {}}
