"""Requests through the command service at once: many in flight, many leases per request, and
pools read from a cache the log invalidates."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from projections.decisions import count_events
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane

Plane = tuple[ControlPlane, PoolClient, PoolClient]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    cp = start(fresh_nats.url, FakeClock())
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0})
    assert admin.admin("node.register", node_body("n1", cpu_millis=64000,
                                                  memory_mib=262144))["ok"]
    yield cp, admin, alpha
    alpha.close()
    admin.close()
    cp.stop()


def _events(cp: ControlPlane) -> int:
    return cp.app.recorder.max_notification_id() or 0


def test_a_request_for_five_leases_is_one_save_and_its_reply_lists_every_id(
        plane: Plane) -> None:
    cp, _admin, alpha = plane
    before = _events(cp)
    r = alpha.request_lease({**lease_body("array-1"), "count": 5})
    assert r["ok"], r
    ids = r["result"]["lease_ids"]
    assert len(set(ids)) == 5 and r["lease"]["lease_id"] == ids[0]
    assert _events(cp) == before + 5  # one event a lease: requested and queued
    # each an ordinary lease afterwards: readable, and placed like any other
    assert all(alpha.lease(i, "get")["lease"]["state"] == "queued" for i in ids)
    assert cp.scheduler.cycle().placed == 5
    # the same request again: the same ids, nothing appended
    after = _events(cp)
    again = alpha.request_lease({**lease_body("array-1"), "count": 5})
    assert again["result"]["lease_ids"] == ids and _events(cp) == after


def test_a_key_used_for_one_lease_is_refused_for_an_array(plane: Plane) -> None:
    _cp, _admin, alpha = plane
    assert alpha.request_lease(lease_body("k"))["ok"]
    r = alpha.request_lease({**lease_body("k"), "count": 3})
    assert not r["ok"] and r["error"]["code"] == "idempotency_conflict"


def test_a_count_at_the_limit_is_one_save_and_one_more_is_refused_naming_the_field(
        plane: Plane) -> None:
    from schemas.v1 import MAX_LEASES_PER_REQUEST

    cp, _admin, alpha = plane
    assert MAX_LEASES_PER_REQUEST == 999  # one event a lease: 999 fit one atomic batch
    before = _events(cp)
    r = alpha.request_lease({**lease_body("too-many"), "count": MAX_LEASES_PER_REQUEST + 1})
    assert not r["ok"] and r["error"]["code"] == "invalid_field"
    assert r["error"]["reasons"]["path"] == "$.count" and _events(cp) == before
    r = alpha.request_lease({**lease_body("at-the-limit"), "count": MAX_LEASES_PER_REQUEST})
    assert r["ok"], r
    ids = r["result"]["lease_ids"]
    assert len(set(ids)) == MAX_LEASES_PER_REQUEST and r["lease"]["lease_id"] == ids[0]
    assert _events(cp) == before + MAX_LEASES_PER_REQUEST


def test_concurrent_requests_are_in_flight_together_and_share_round_trips(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, _admin, _alpha = plane
    clients = [PoolClient(fresh_nats.url, "alpha") for _ in range(24)]
    answers: list[Any] = [None] * len(clients)
    gate = threading.Barrier(len(clients))

    def send(i: int) -> None:
        gate.wait()
        answers[i] = [clients[i].request_lease(lease_body(f"c{i}-{n}"))["ok"] for n in range(5)]

    group = cp.app.recorder._group  # type: ignore[attr-defined]
    batches, rounds, saves = group.batches, group.rounds, group.saves
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert answers == [[True] * 5] * len(clients)
    # served one at a time, every save would be a round trip of its own; shared, they rode
    # atomic batches or rounds of plain publishes together
    trips = (group.batches - batches) + (group.rounds - rounds)
    assert group.saves - saves == 120 and 0 < trips < 120
    counts = count_events(cp.app, {"LeaseRequested"})
    assert sum(counts.values()) == 120 and set(counts.values()) == {1}


def test_a_pool_change_reaches_requests_without_waiting_out_the_cache(plane: Plane) -> None:
    _cp, admin, alpha = plane
    assert alpha.request_lease(lease_body("warm"))["ok"]  # the pool is cached now
    refused = alpha.request_lease(lease_body("urgent-0", priority="urgent"))
    assert not refused["ok"]
    assert admin.admin("pool.set", {"pool_id": "p1", "priority_classes": {
        "preemptible": 0, "standard": 10, "high": 20, "urgent": 30}})["ok"]
    assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                      "priority_classes": ["urgent"]})["ok"]
    deadline = time.monotonic() + 2.0  # well inside the cache's own lifetime
    n = 0
    while True:
        n += 1
        r = alpha.request_lease(lease_body(f"urgent-{n}", priority="urgent"))
        if r["ok"] or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert r["ok"], r


def test_pool_lease_request_count_prints_every_id(fresh_nats: NatsServer, plane: Plane) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "lease", "request", "--nats-url", fresh_nats.url,
         "--tenant", "alpha", "--pool", "p1", "--cpu-millis", "100", "--memory-mib", "64",
         "--max-runtime", "60", "--key", "cli-array", "--count", "3"],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert len(set(done.stdout.split())) == 3
    bad = subprocess.run(
        [sys.executable, "-m", "cli.main", "lease", "request", "--nats-url", fresh_nats.url,
         "--tenant", "alpha", "--pool", "p1", "--cpu-millis", "100", "--memory-mib", "64",
         "--max-runtime", "60", "--count", "0"],
        capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "--count" in bad.stderr


def test_a_node_heartbeat_passes_over_reserved_leases_without_loading_them(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, _admin, alpha = plane
    ids = alpha.request_lease({**lease_body("held"), "count": 4})["result"]["lease_ids"]
    assert cp.scheduler.cycle().placed == 4  # reserved on n1, awaiting their commits
    loaded: list[Any] = []
    find = cp.app.store.find

    def counting_find(cls: Any, uid: Any) -> Any:
        loaded.append((cls.__name__, str(uid)))
        return find(cls, uid)

    cp.app.store.find = counting_find  # type: ignore[method-assign]
    node = PoolClient(fresh_nats.url, inbox_prefix=b"_INBOX.n.n1")
    try:
        r = node.call("pool.node.n1.heartbeat", {"node_id": "n1", "seq": 1, "leases": []})
    finally:
        node.close()
    assert r["ok"], r
    assert not [i for name, i in loaded if name == "Lease" and i in ids]


def test_two_command_processes_share_the_requests_and_lose_or_double_none(
        fresh_nats: NatsServer, plane: Plane) -> None:
    cp, _admin, alpha = plane
    group = cp.app.recorder._group  # type: ignore[attr-defined]
    other = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--role", "commands",
                              "--nats-url", fresh_nats.url],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # ready once a request is answered without a save in this process
        deadline, n = time.monotonic() + 30, 0
        while True:
            before = group.saves
            n += 1
            assert alpha.request_lease(lease_body(f"probe-{n}"))["ok"]
            if group.saves == before or time.monotonic() > deadline:
                break
        assert group.saves == before, "the second command process never answered"
        clients = [PoolClient(fresh_nats.url, "alpha") for _ in range(16)]
        gate = threading.Barrier(len(clients))
        answers: list[Any] = [None] * len(clients)

        def send(i: int) -> None:
            gate.wait()
            answers[i] = [clients[i].request_lease(lease_body(f"two-{i}-{k}"))["ok"]
                          for k in range(8)]

        here = group.saves
        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for c in clients:
            c.close()
        assert answers == [[True] * 8] * len(clients)
        assert 0 < group.saves - here < 128  # the queue group spread them over both
        counts = count_events(cp.app, {"LeaseRequested"})
        assert sum(counts.values()) == 128 + n and set(counts.values()) == {1}
    finally:
        other.terminate()
        other.wait(30)
