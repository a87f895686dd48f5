"""PostgreSQL views of the log: contents, exactly-once under SIGKILL, rebuild, tenant queries."""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from projections import views as pv
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.application import PoolApp
from workers.bootstrap import app_env, application
from workers.commands import QUERY_SUBJECTS, CommandHandler
from workers.plane import ControlPlane
from workers.projector import Projector

ROOT = Path(__file__).resolve().parents[2]
JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}
PRICES = {"pool_id": "p1", "cpu_core_second": 7, "memory_gib_second": 3}


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, PoolClient, FakeClock]]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, credits=10**9)
    assert admin.admin("pool.prices", PRICES)["ok"]
    assert admin.admin("node.register", node_body("n1"))["ok"]
    yield cp, admin, clock
    admin.close()
    cp.stop()


def catch_up(cp: ControlPlane, database_url: str, schema: str, batch: int = 1000) -> int:
    proj = pv.PoolViews(cp.app, database_url, schema=schema)
    proj.setup()
    try:
        return proj.catch_up(batch_size=batch)
    finally:
        proj.close()


def rows(database_url: str, schema: str, q: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute(q.replace("{s}", f'"{schema}"'), params).fetchall()


def assert_equal_to_rebuild(app: PoolApp, database_url: str, schema: str) -> None:
    pv.rebuild(app, database_url, schema=f"{schema}_rebuilt")
    for view in pv.VIEWS:
        assert pv.dump(database_url, schema, view) == pv.dump(
            database_url, f"{schema}_rebuilt", view), view
    live = {r[0]: r[1:] for r in rows(database_url, schema,
            "SELECT view_name, notification_id, events_applied FROM {s}.tracking")}
    again = {r[0]: r[1:] for r in rows(database_url, f"{schema}_rebuilt",
             "SELECT view_name, notification_id, events_applied FROM {s}.tracking")}
    assert live == again


def flow(cp: ControlPlane, clock: FakeClock, alpha: PoolClient) -> str:
    lid = alpha.request_lease(lease_body("job-1", cpu_millis=2000, memory_mib=2048))["lease"][
        "lease_id"]
    assert cp.scheduler.cycle().placed == 1
    assert alpha.lease(lid, "commit", JOB)["ok"]
    clock.advance(10.5)
    assert alpha.lease(lid, "release", {"exit_code": 0})["ok"]
    return str(lid)


def test_views_follow_request_reserve_commit_release_with_credits(
    plane: tuple[ControlPlane, PoolClient, FakeClock], database_url: str, schema: str
) -> None:
    cp, _admin, clock = plane
    with PoolClient(cp.nats_url, "alpha") as alpha:
        lid = alpha.request_lease(lease_body("job-1", cpu_millis=2000, memory_mib=2048))[
            "lease"]["lease_id"]
        catch_up(cp, database_url, schema)
        assert rows(database_url, schema, "SELECT lease_id, tenant, pool, state FROM {s}.queue") \
            == [(lid, "alpha", "p1", "queued")]
        cp.scheduler.cycle()
        waiting = alpha.request_lease(lease_body("waits", cpu_millis=7000))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 0
        assert alpha.lease(lid, "commit", JOB)["ok"]
        catch_up(cp, database_url, schema)
        (state, node, held), = rows(database_url, schema,
                                    "SELECT state, node_id, credits_held FROM {s}.leases "
                                    "WHERE lease_id = %s", lid)
        assert (state, node) == ("running", "n1") and held > 0
        (cpu_alloc, mem_alloc, zone), = rows(
            database_url, schema,
            "SELECT cpu_millis_allocated, memory_mib_allocated, zone FROM {s}.capacity")
        assert (cpu_alloc, mem_alloc, zone) == (2000, 2048, "z1")
        clock.advance(10.5)
        assert alpha.lease(lid, "release", {"exit_code": 0})["ok"]
    catch_up(cp, database_url, schema)
    expected_charge = (2 * 7 + 2 * 3) * 11  # 2 cores, 2 GiB, 10.5 s billed as 11
    (state, charged, held_now, released), = rows(
        database_url, schema,
        "SELECT state, credits_charged, credits_held, credits_released FROM {s}.leases "
        "WHERE lease_id = %s", lid)
    assert (state, charged, held_now) == ("released", expected_charge, 0) and released > 0
    bal = rows(database_url, schema,
               "SELECT tenant, granted, held, spent, available, shortfall FROM {s}.balance "
               "ORDER BY tenant")
    assert bal[0] == ("alpha", 10**9, 0, expected_charge, 10**9 - expected_charge, 0)
    assert bal[1] == ("beta", 10**9, 0, 0, 10**9, 0)
    assert rows(database_url, schema, "SELECT cpu_millis_allocated FROM {s}.capacity") == [(0,)]
    assert rows(database_url, schema, "SELECT lease_id FROM {s}.queue") == [(waiting,)]
    status = {s["view"]: s for s in pv.status(database_url, cp.app.recorder.max_notification_id()
                                              or 0, schema=schema)}
    assert all(s["lag"] == 0 and s["position"] > 0 for s in status.values())
    assert_equal_to_rebuild(cp.app, database_url, schema)


def test_holds_of_one_cycle_recorded_as_one_event_reach_every_leases_row(
    plane: tuple[ControlPlane, PoolClient, FakeClock], database_url: str, schema: str
) -> None:
    """The scheduler records a tenant's holds of one batch as one CreditsHeldBatch: the
    leases view credits each lease its own hold, the balance view the sum."""
    cp, _admin, clock = plane
    with PoolClient(cp.nats_url, "alpha") as alpha:
        ids = [alpha.request_lease(lease_body(f"b{i}", cpu_millis=1000 * (i + 1)))["lease"][
            "lease_id"] for i in range(3)]
        assert cp.scheduler.cycle().placed == 3
        topics = [n.topic for n in cp.app.recorder.select_notifications(start=1, limit=10_000)]
        assert sum(t.endswith(".CreditsHeldBatch") for t in topics) == 1
        assert not any(t.endswith(".CreditsHeld") for t in topics)
        catch_up(cp, database_url, schema)
        held = dict(rows(database_url, schema,
                         "SELECT lease_id, credits_held FROM {s}.leases WHERE tenant = 'alpha'"))
        hold_each = {lid: alpha.lease(lid, "get")["lease"]["hold_microcredits"] for lid in ids}
        assert held == hold_each and len(set(held.values())) == 3  # each its own amount
        (bal_held,), = rows(database_url, schema,
                            "SELECT held FROM {s}.balance WHERE tenant = 'alpha'")
        assert bal_held == sum(hold_each.values())
        assert alpha.lease(ids[0], "commit", JOB)["ok"]
        clock.advance(3.2)
        assert alpha.lease(ids[0], "release", {"exit_code": 0})["ok"]
        assert alpha.lease(ids[1], "cancel", {"reason": "test"})["ok"]
    catch_up(cp, database_url, schema)
    charge = (1 * 7 + 1 * 3) * 4  # 1 core, 1 GiB, 3.2 s billed as 4
    (state, charged, held_now), = rows(
        database_url, schema, "SELECT state, credits_charged, credits_held FROM {s}.leases "
        "WHERE lease_id = %s", ids[0])
    assert (state, charged, held_now) == ("released", charge, 0)
    (bal_held, spent), = rows(database_url, schema,
                              "SELECT held, spent FROM {s}.balance WHERE tenant = 'alpha'")
    assert (bal_held, spent) == (hold_each[ids[2]], charge)
    assert_equal_to_rebuild(cp.app, database_url, schema)


def test_a_projector_thread_keeps_up_and_small_batches_equal_a_rebuild(
    plane: tuple[ControlPlane, PoolClient, FakeClock], database_url: str, schema: str
) -> None:
    cp, _admin, clock = plane
    proj = Projector(application(cp.nats_url), database_url, schema=schema, batch_size=3).start()
    try:
        with PoolClient(cp.nats_url, "alpha") as alpha:
            flow(cp, clock, alpha)
        assert proj.wait_until(cp.app.recorder.max_notification_id() or 0)
    finally:
        proj.stop()
    assert_equal_to_rebuild(cp.app, database_url, schema)


def _spawn(nats_url: str, database_url: str, schema: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "workers.projector", "--nats-url", nats_url, "--database-url",
         database_url, "--schema", schema, "--batch-size", "7"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def test_views_are_exactly_once_when_the_projector_is_killed_mid_stream(
    fresh_nats: NatsServer, database_url: str, schema: str
) -> None:
    clock = FakeClock()
    app = PoolApp(env=app_env(fresh_nats.url), clock=clock)
    grants = 400
    parts = 5
    kills = 0

    def append() -> None:
        # in parts, each after one more kill: however long a projector takes to start (its
        # imports alone can outlast a kill interval on a loaded machine), kills land while the
        # log is still growing, not only after the last append
        for i in range(grants):
            part = i * parts // grants
            deadline = time.monotonic() + 60
            while kills < part and time.monotonic() < deadline:
                time.sleep(0.01)
            app.grant(f"t{i % 5}", 1000 + i, f"grant-{i}")
            time.sleep(0.005)

    def position() -> int:
        return min((p for p, _ in _tracking(database_url, schema).values()), default=0)

    def wait_until_applying(since: int) -> None:
        """Until the projector just started has committed a batch (or has nothing to do):
        a kill before that would only test an interrupted import."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            at = position()
            if at > since or (not writer.is_alive()
                              and at >= (app.recorder.max_notification_id() or 0)):
                return
            time.sleep(0.02)

    try:
        writer = threading.Thread(target=append)
        proc = _spawn(fresh_nats.url, database_url, schema)
        writer.start()
        at_kill: list[int] = []
        rng = random.Random(4)
        while writer.is_alive() or kills < 5:
            wait_until_applying(at_kill[-1] if at_kill else 0)
            time.sleep(rng.uniform(0.0, 0.5))  # lands mid-batch, mid-stream, or while idle
            at_kill.append(position())
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            proc = _spawn(fresh_nats.url, database_url, schema)
        writer.join()
        top = app.recorder.max_notification_id() or 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pos = [p for p, _ in _tracking(database_url, schema).values()]
            if len(pos) == len(pv.VIEWS) and min(pos) >= top:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert kills >= 5
        assert len({p for p in at_kill if 0 < p < top}) >= 2, at_kill  # killed mid-stream
        tracked = _tracking(database_url, schema)
        assert all(p == top for p, _ in tracked.values()), tracked
        # per grant its event and its transfer id's claim (plus the account openings): none
        # lost, none applied twice
        assert all(applied == 2 * grants + 5 for _, applied in tracked.values()), tracked
        bal = dict(rows(database_url, schema, "SELECT tenant, granted FROM {s}.balance"))
        assert bal == {f"t{k}": sum(1000 + i for i in range(grants) if i % 5 == k)
                       for k in range(5)}
        assert_equal_to_rebuild(app, database_url, schema)
    finally:
        app.close()


def _tracking(database_url: str, schema: str) -> dict[str, tuple[int, int]]:
    try:
        with psycopg.connect(database_url) as conn:
            return pv.positions(conn, schema)
    except psycopg.Error:
        return {}


def test_tenants_see_only_their_own_rows_through_the_query_subject(
    fresh_nats: NatsServer, database_url: str, schema: str
) -> None:
    from bus.service import Service

    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    queries = Service(fresh_nats.url, QUERY_SUBJECTS,
                      CommandHandler(cp.app, database_url=database_url, views_schema=schema),
                      queue="pool-queries").start()
    try:
        with PoolClient(fresh_nats.url) as admin:
            setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, credits=10**9)
            assert admin.admin("node.register", node_body("n1"))["ok"]
        with PoolClient(fresh_nats.url, "alpha") as alpha, \
                PoolClient(fresh_nats.url, "beta") as beta:
            mine = {alpha.request_lease(lease_body(f"a{i}"))["lease"]["lease_id"]
                    for i in range(3)}
            theirs = {beta.request_lease(lease_body(f"b{i}"))["lease"]["lease_id"]
                      for i in range(2)}
            catch_up(cp, database_url, schema)
            for client, own, other in ((alpha, mine, theirs), (beta, theirs, mine)):
                for view in ("queue", "leases"):
                    r = client.call(f"pool.cmd.{client.tenant}.query.{view}", {})
                    assert r["ok"], r
                    got = {row["lease_id"] for row in r["result"]["rows"]}
                    assert got == own and not got & other
                    assert {row["tenant"] for row in r["result"]["rows"]} == {client.tenant}
                b = client.call(f"pool.cmd.{client.tenant}.query.balance", {})
                assert [row["tenant"] for row in b["result"]["rows"]] == [client.tenant]
                # a filter naming another tenant's lease finds nothing
                probe = client.call(f"pool.cmd.{client.tenant}.query.leases",
                                    {"filters": {"lease_id": next(iter(other))}})
                assert probe["ok"] and probe["result"]["rows"] == []
            page1 = alpha.call("pool.cmd.alpha.query.leases", {"limit": 2})["result"]
            assert len(page1["rows"]) == 2 and page1["next_cursor"]
            page2 = alpha.call("pool.cmd.alpha.query.leases",
                               {"limit": 2, "cursor": page1["next_cursor"]})["result"]
            assert {r["lease_id"] for r in page1["rows"] + page2["rows"]} == mine
            assert page2["next_cursor"] is None
            bad = alpha.call("pool.cmd.alpha.query.leases", {"filters": {"tenant": "beta"}})
            assert not bad["ok"] and bad["error"]["code"] == "invalid_field"
            nope = alpha.call("pool.cmd.alpha.query.capacity", {})
            assert not nope["ok"]
    finally:
        queries.stop()
        cp.stop()


def test_two_projectors_and_a_rebuild_at_once_apply_every_event_exactly_once(
    fresh_nats: NatsServer, database_url: str, schema: str
) -> None:
    """Projectors fold a batch while the previous one is written, each batch sent only if the
    views are still where it was built for: two of them on one schema while the log grows, and
    a rebuild of one view in the middle (its position goes back), still end exactly at the
    log's fold, every event counted once per view."""
    from bench.projections import Workload

    app = PoolApp(env=app_env(fresh_nats.url))
    work = Workload(6, 3, prefix="x-")
    app.save(*work.setup())
    projectors = [Projector(application(fresh_nats.url), database_url, schema=schema, batch_size=size)
                  for size in (40, 170)]
    try:
        projectors[0].views.setup()
        for p in projectors:
            p.start()
        for i in range(12):
            aggs, _n = work.batch(300)
            app.save(*aggs)
            if i == 6:
                pv.rebuild(app, database_url, schema=schema, views=["balance"], batch_size=90)
            time.sleep(0.05)
        top = app.recorder.max_notification_id() or 0
        assert all(p.wait_until(top, timeout=60) for p in projectors)
    finally:
        for p in projectors:
            p.stop()
        app.close()
    tracked = _tracking(database_url, schema)
    assert all(at == top and applied == top for at, applied in tracked.values()), tracked
    assert gc.isenabled()  # paused while they caught up (batches of 300 > 40), back on now
    app = PoolApp(env=app_env(fresh_nats.url))
    try:
        assert_equal_to_rebuild(app, database_url, schema)
    finally:
        app.close()
