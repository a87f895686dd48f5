"""The scheduler's checkpoint against a real log: restored and folded to the end it equals a
full replay; an altered, foreign or ahead-of-log checkpoint is refused and the replay is full."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from bus.checkpoints import CheckpointStore
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, node_report, setup_pool, start
from tests.integration.test_gang_leases import gang_body, gpu_node
from tests.scheduler_state import differences, fold_of
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.plane import ControlPlane
from workers.scheduler import Scheduler
from workers.scheduler.checkpoint import Checkpointer

KEY = b"k" * 32
PREEMPTION = {"enabled": True, "min_runtime_seconds": 0, "grace_seconds": 10}
WHOLE = 8000

Plane = tuple[ControlPlane, PoolClient, FakeClock]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    CheckpointStore(fresh_nats.url).ensure()
    yield cp, admin, clock
    admin.close()
    cp.stop()


def _scheduler(cp: ControlPlane, clock: FakeClock, key: bytes | None = KEY) -> Scheduler:
    s = Scheduler(PoolApp(env=app_env(cp.nats_url), clock=clock), clock=clock)
    if key is not None:
        s.checkpoints = Checkpointer(CheckpointStore(cp.nats_url), key)
    return s


def _close(*schedulers: Scheduler) -> None:
    for s in schedulers:
        s.close()
        s.app.close()


def _first_half(cp: ControlPlane, admin: PoolClient, clock: FakeClock) -> dict[str, str]:
    """A pool with quotas in a cohort, a maintenance window and an advance reservation; leases
    running (one a gang), reserved, preempting for a waiting one, queued, ended, rejected."""
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 2.0, "gamma": 1.0}, preemption=PREEMPTION)
    assert admin.admin("cohort.set", {"pool_id": "p1", "name": "research"})["ok"]
    assert admin.admin("tenant.set", {"tenant": "gamma", "pool_id": "p1", "weight": 1.0,
                                      "cohort": "research", "nominal": {"cpu_millis": WHOLE}})["ok"]
    assert admin.admin("tenant.set", {"tenant": "beta", "pool_id": "p1", "weight": 2.0,
                                      "quota": {"cpu_millis": 4 * WHOLE},
                                      "priority_classes": ["high"]})["ok"]
    for n in ("n1", "n2"):
        assert admin.admin("node.register", node_body(n, cpu_millis=WHOLE))["ok"]
    for i in range(2):
        assert admin.admin("node.register", gpu_node(f"r1-n{i}", "r1"))["ok"]
    assert admin.admin("reservation.create", {
        "pool_id": "p1", "reservation_id": "m1", "start_at": clock() + 7200,
        "duration_seconds": 600, "node_ids": ["r1-n1"]})["ok"]
    assert admin.admin("reservation.create", {
        "pool_id": "p1", "reservation_id": "ar1", "tenant": "beta", "start_at": clock() + 3600,
        "duration_seconds": 600, "shape": {"cpu_millis": 1000, "memory_mib": 1024}})["ok"]
    ids: dict[str, str] = {}
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b, \
            PoolClient(cp.nats_url, "gamma") as g:
        ids["running"] = a.request_lease(lease_body("run", cpu_millis=WHOLE) | {
            "preemptible_requeue": True})["lease"]["lease_id"]
        gang = a.request_lease(gang_body("gang", 2))["result"]["lease_ids"]
        ids["gang"] = gang[0]
        assert cp.scheduler.cycle().placed == 3
        assert a.lease(ids["running"], "commit", {})["ok"]
        assert a.lease(ids["gang"], "commit", {})["ok"]
        ids["ended"] = a.request_lease(lease_body("gone"))["lease"]["lease_id"]
        assert a.lease(ids["ended"], "cancel", {})["ok"]
        ids["rejected"] = a.request_lease(lease_body("huge", cpu_millis=64_000))["lease"][
            "lease_id"]
        clock.advance(30)
        assert a.lease(ids["running"], "heartbeat", {"epoch": 1})["ok"]
        assert a.lease(ids["gang"], "heartbeat", {"epoch": 1})["ok"]
        ids["urgent"] = b.request_lease(lease_body("urgent", cpu_millis=WHOLE, priority="high"))[
            "lease"]["lease_id"]
        ids["reserved"] = b.request_lease(lease_body("small", cpu_millis=1000))["lease"][
            "lease_id"]
        for i in range(3):
            ids[f"queued{i}"] = g.request_lease(lease_body(f"q{i}", cpu_millis=WHOLE))["lease"][
                "lease_id"]
        report = cp.scheduler.cycle()
        assert report.preempted >= 1 and report.rejected == 1, report
        assert a.lease(ids["running"], "get")["lease"]["state"] == "preempting"
        assert b.lease(ids["reserved"], "get")["lease"]["state"] == "reserved"
    return ids


def _second_half(cp: ControlPlane, admin: PoolClient, clock: FakeClock,
                 ids: dict[str, str]) -> None:
    """The victim stops and is requeued, the urgent lease placed; more requests, a cancel, a
    released lease, a quota changed, a node cordoned."""
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b, \
            PoolClient(cp.nats_url, "gamma") as g:
        victim = a.lease(ids["running"], "get")["lease"]
        assert node_report(cp.nats_url, victim["node_id"], ids["running"], "stopped",
                           {"epoch": victim["epoch"]})["ok"]
        clock.advance(5)
        cp.scheduler.cycle()
        assert b.lease(ids["urgent"], "get")["lease"]["state"] == "reserved"
        assert b.lease(ids["reserved"], "commit", {})["ok"]
        assert b.lease(ids["reserved"], "release", {})["ok"]
        assert g.lease(ids["queued2"], "cancel", {})["ok"]
        for i in range(3):
            assert a.request_lease(lease_body(f"late{i}", cpu_millis=500))["ok"]
        assert admin.admin("tenant.set", {"tenant": "gamma", "pool_id": "p1", "weight": 3.0,
                                          "cohort": "research",
                                          "nominal": {"cpu_millis": 2 * WHOLE}})["ok"]
        assert admin.admin("node.n2.cordon", {"reason": "disk"})["ok"]
        clock.advance(5)
        cp.scheduler.cycle()


def _assert_same(restored: Scheduler, replayed: Scheduler) -> None:
    a, b = fold_of(restored), fold_of(replayed)
    diff = differences(a, b)
    assert not diff, "\n".join(diff)
    assert a == b


def test_a_fold_checkpointed_mid_log_and_folded_to_the_end_equals_the_full_replay(
        plane: Plane) -> None:
    cp, admin, clock = plane
    ids = _first_half(cp, admin, clock)
    writer = _scheduler(cp, clock)
    writer.catch_up()
    assert writer.checkpoints is not None and writer.checkpoints.write_now(writer)
    middle = writer.position
    _second_half(cp, admin, clock, ids)
    restored, replayed = _scheduler(cp, clock), _scheduler(cp, clock, key=None)
    try:
        restored.catch_up()
        replayed.catch_up()
        assert restored.checkpoints is not None and restored.checkpoints.restored_at == middle
        assert restored.position == replayed.position > middle
        states = {str(getattr(x, "state", "")) for x in replayed.aggregates.values()}
        assert {"queued", "reserved", "preempting", "cordoned"} <= states, states
        assert replayed._ended and replayed._usage
        assert replayed.windows._by_pool["p1"].keys() == {"m1", "ar1"}
        _assert_same(restored, replayed)
        # the restored one places the next request as the full replay would have
        with PoolClient(cp.nats_url, "beta") as b:
            lid = b.request_lease(lease_body("next", cpu_millis=500))["lease"]["lease_id"]
            assert restored.cycle().conflicts == 0
            assert b.lease(lid, "get")["lease"]["state"] == "reserved"
    finally:
        _close(writer, restored, replayed)


def test_a_placing_schedulers_checkpoint_restores_what_its_cycles_learnt(plane: Plane) -> None:
    """Reasons, the queue's positions, backfill, gang holds and the own-batch ranges come
    back as the writer left them, not only what a fold of the log gives."""
    cp, admin, clock = plane
    _first_half(cp, admin, clock)
    live = cp.scheduler
    live.checkpoints = Checkpointer(CheckpointStore(cp.nats_url), KEY)
    live.cycle()
    assert live.reasons
    assert live.checkpoints.write_now(live)
    restored = _scheduler(cp, clock)
    try:
        assert restored.checkpoints is not None and restored.checkpoints.restore(restored)
        _assert_same(restored, live)
    finally:
        live.checkpoints = None
        _close(restored)


def _written(cp: ControlPlane, clock: FakeClock) -> tuple[CheckpointStore, bytes, bytes]:
    writer = _scheduler(cp, clock)
    writer.catch_up()
    assert writer.checkpoints is not None and writer.checkpoints.write_now(writer)
    _close(writer)
    store = CheckpointStore(cp.nats_url)
    got = store.get()
    assert got is not None
    return store, got[0], got[1]


def _resigned(head: bytes, body: bytes, **change: Any) -> bytes:
    fields = json.loads(head)
    fields.update(change)
    signer = Checkpointer(CheckpointStore.__new__(CheckpointStore), KEY)
    fields["mac"] = signer._mac(fields, body).hex()
    return json.dumps(fields).encode()


@pytest.mark.parametrize("alteration", [
    "a_byte_of_its_body", "another_key", "other_code", "a_position_past_the_log",
    "another_log_at_its_position", "no_checkpoint"])
def test_a_checkpoint_that_does_not_verify_is_refused_and_the_replay_is_full(
        plane: Plane, alteration: str, caplog: pytest.LogCaptureFixture) -> None:
    cp, admin, clock = plane
    ids = _first_half(cp, admin, clock)
    store, head, body = _written(cp, clock)
    key = KEY
    if alteration == "a_byte_of_its_body":
        body = body[:100] + bytes([body[100] ^ 1]) + body[101:]
    elif alteration == "another_key":
        key = b"x" * 32
    elif alteration == "other_code":
        head = _resigned(head, body, code="0" * 64)
    elif alteration == "a_position_past_the_log":
        at = json.loads(head)["at"]
        head = _resigned(head, body, position=at[0] + 1000, at=[at[0] + 1000, *at[1:]])
    elif alteration == "another_log_at_its_position":
        at = json.loads(head)["at"]
        head = _resigned(head, body, at=[at[0], "00000000-0000-0000-0000-000000000000", 1])
    if alteration == "no_checkpoint":
        store.delete()
    else:
        store.put(head, body)
    _second_half(cp, admin, clock, ids)
    restored, replayed = _scheduler(cp, clock, key=key), _scheduler(cp, clock, key=None)
    try:
        caplog.clear()  # only what the restore says; the writes above may log too
        with caplog.at_level(logging.INFO, logger="workers.scheduler.checkpoint"):
            restored.catch_up()
        assert restored.checkpoints is not None and restored.checkpoints.restored_at is None
        lines = [r for r in caplog.records if r.name == "workers.scheduler.checkpoint"]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "replaying the log from the start" in lines[0].getMessage()
        replayed.catch_up()
        _assert_same(restored, replayed)
    finally:
        _close(restored, replayed)


@pytest.mark.parametrize("name", [("workers.bootstrap", "os"), ("workers.bootstrap", "os.system"),
                                  ("builtins", "eval"), ("subprocess", "Popen")])
def test_the_unpickler_refuses_anything_but_the_folds_own_types(name: tuple[str, str]) -> None:
    """Behind the signature, a second wall: were the key to leak, a checkpoint still could
    not name a module, a builtin that runs code, or anything outside the fold's packages."""
    import io
    import pickle

    from workers.scheduler.checkpoint import _Unpickler

    module, attr = name
    forged = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c" + bytes([len(module)]) + \
        module.encode() + b"\x8c" + bytes([len(attr)]) + attr.encode() + b"\x93."
    with pytest.raises(pickle.UnpicklingError):
        _Unpickler(io.BytesIO(forged)).load()
    assert _Unpickler(io.BytesIO(pickle.dumps({"x": frozenset({1})}))).load() == {
        "x": frozenset({1})}


def test_a_fold_that_cannot_be_checkpointed_is_logged_and_the_scheduler_goes_on(
        plane: Plane, caplog: pytest.LogCaptureFixture) -> None:
    import threading

    cp, admin, clock = plane
    setup_pool(admin)
    assert admin.admin("node.register", node_body("n1"))["ok"]
    s = _scheduler(cp, clock)
    try:
        assert s.checkpoints is not None
        s.checkpoints.every_events = 1
        s.catch_up()
        s.reasons["odd"] = {"a lock": threading.Lock()}  # something no pickle takes
        with caplog.at_level(logging.ERROR, logger="workers.scheduler.checkpoint"):
            assert s.checkpoints.after_cycle(s, idle=True) is False
        assert "reasons" in caplog.text and s.checkpoints.written == 0
        with PoolClient(cp.nats_url, "alpha") as a:
            lid = a.request_lease(lease_body("still"))["lease"]["lease_id"]
            assert s.cycle().placed == 1
            assert a.lease(lid, "get")["lease"]["state"] == "reserved"
    finally:
        _close(s)


def test_a_checkpoint_that_held_the_lock_long_waits_a_hundred_times_that_for_the_next(
        plane: Plane) -> None:
    cp, admin, clock = plane
    setup_pool(admin)
    s = _scheduler(cp, clock)
    try:
        assert s.checkpoints is not None
        s.checkpoints.every_events = 1
        s.catch_up()
        s.checkpoints.last_pause_seconds = 5.0  # as if the last one paused placing for 5 s
        assert s.checkpoints.after_cycle(s, idle=True) is False
        s.checkpoints.last_pause_seconds = 0.0
        assert s.checkpoints.after_cycle(s, idle=True) is True
        s.checkpoints.wait(30)
        assert s.checkpoints.written == 1
    finally:
        _close(s)
