"""The views as they were at a time (`--at`, `?at=`): rebuilt from the row versions the
projector keeps and each second's last event, equal to what the views held then."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from bus.local.server import NatsServer
from bus.service import Service
from cli.main import main
from client.api import PoolClient
from projections import views as pv
from projections.errors import BadQuery
from projections.queries import query
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.commands import QUERY_SUBJECTS, CommandHandler
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}


@pytest.fixture()
def plane(fresh_nats: NatsServer, database_url: str, schema: str
          ) -> Iterator[tuple[ControlPlane, PoolClient, FakeClock]]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    queries = Service(fresh_nats.url, QUERY_SUBJECTS,
                      CommandHandler(cp.app, database_url=database_url, views_schema=schema),
                      queue="pool-queries").start()
    admin = PoolClient(fresh_nats.url)
    setup_pool(admin, tenants={"alpha": 1.0}, credits=10**9)
    assert admin.admin("node.register", node_body("n1"))["ok"]
    yield cp, admin, clock
    admin.close()
    queries.stop()
    cp.stop()


def _catch_up(cp: ControlPlane, database_url: str, schema: str) -> None:
    proj = pv.PoolViews(cp.app, database_url, schema=schema)
    proj.setup()
    try:
        proj.catch_up(batch_size=7)  # batches that split the story: versions per batch
    finally:
        proj.close()


def _pause() -> float:
    """A time between two steps, a second clear of both (event times are kept per second)."""
    time.sleep(1.05)
    then = time.time()
    time.sleep(1.05)
    return then


def _view(database_url: str, schema: str, view: str, at: float | None) -> list[dict[str, object]]:
    with psycopg.connect(database_url) as conn:
        return list(query(conn, view, tenant=None, schema=schema, at=at)["rows"])


def test_each_view_reads_as_it_was_before_during_and_after_a_lease(
    plane: tuple[ControlPlane, PoolClient, FakeClock], database_url: str, schema: str
) -> None:
    cp, _admin, clock = plane
    with PoolClient(cp.nats_url, "alpha") as alpha:
        before = _pause()
        lid = alpha.request_lease(lease_body("job-1", cpu_millis=2000, memory_mib=2048))[
            "lease"]["lease_id"]
        _catch_up(cp, database_url, schema)
        queued = _pause()
        assert cp.scheduler.cycle().placed == 1
        assert alpha.lease(lid, "commit", JOB)["ok"]
        _catch_up(cp, database_url, schema)
        running = _pause()
        clock.advance(10.5)
        assert alpha.lease(lid, "release", {"exit_code": 0})["ok"]
    _catch_up(cp, database_url, schema)

    def states(at: float | None) -> tuple[object, ...]:
        leases = {r["lease_id"]: r["state"] for r in _view(database_url, schema, "leases", at)}
        queue = [r["lease_id"] for r in _view(database_url, schema, "queue", at)]
        (node,) = _view(database_url, schema, "capacity", at) or [{}]
        (acc,) = _view(database_url, schema, "balance", at)
        return leases.get(lid), queue, node.get("cpu_millis_allocated"), acc["granted"]

    assert states(before) == (None, [], 0, 10**9)
    _the_commands_answer_as_then(cp, database_url, schema, lid, queued, running)
    assert states(queued) == ("queued", [lid], 0, 10**9)
    assert states(running) == ("running", [], 2000, 10**9)
    assert states(time.time()) == states(None) == ("released", [], 0, 10**9)
    # the past as read equals the view itself at every column, now
    assert _view(database_url, schema, "leases", time.time()) == _view(
        database_url, schema, "leases", None)


def test_a_time_the_views_cannot_answer_is_a_typed_refusal(
    database_url: str, schema: str
) -> None:
    with psycopg.connect(database_url) as conn:
        pv.create_schema(conn, schema)
        with pytest.raises(BadQuery, match="no past"):
            query(conn, "gangs", tenant=None, schema=schema, at=time.time())
        with pytest.raises(BadQuery, match="epoch seconds"):
            query(conn, "leases", tenant=None, schema=schema, at=float("nan"))


def _cli(*argv: str) -> dict[str, object]:
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([*argv, "--json"])
    assert rc == 0, out.getvalue()
    reply: dict[str, object] = json.loads(out.getvalue())
    return reply


def _the_commands_answer_as_then(cp: ControlPlane, database_url: str, schema: str, lid: str,
                                 queued: float, running: float) -> None:
    """`pool queue|leases|capacity --at`, `pool lease get --at` (the tenant's query subject)
    and `pool shares --at` (the log folded up to then)."""
    db = ["--database-url", database_url, "--schema", schema]
    page = _cli("queue", "--at", str(queued), *db)["result"]
    assert [r["lease_id"] for r in page["rows"]] == [lid] and page["as_of_seq"] > 0  # type: ignore[index]
    assert _cli("queue", "--at", str(running), *db)["result"]["rows"] == []  # type: ignore[index]
    (row,) = _cli("leases", "--at", str(running), *db)["result"]["rows"]  # type: ignore[index]
    assert (row["lease_id"], row["state"]) == (lid, "running")
    (node,) = _cli("capacity", "--at", str(running), *db)["result"]["rows"]  # type: ignore[index]
    assert node["cpu_millis_allocated"] == 2000
    url = ["--nats-url", cp.nats_url, "--tenant", "alpha"]
    got = _cli("lease", "get", lid, "--at", str(queued), *url)["lease"]
    assert got["state"] == "queued" and got["as_of"] == queued  # type: ignore[index]
    shares = _cli("shares", "p1", "--at", str(running), "--nats-url", cp.nats_url)["result"]
    (alpha,) = shares["tenants"]  # type: ignore[index]
    assert alpha["current_share"] > 0  # running then: its 2 cores counted
    shares = _cli("shares", "p1", "--at", str(queued), "--nats-url", cp.nats_url)["result"]
    assert shares["tenants"][0]["current_share"] == 0  # type: ignore[index]


@pytest.mark.parametrize("position", [9, 100], ids=["from-the-view-now", "from-the-start"])
def test_a_row_that_left_the_queue_and_came_back_reads_right_at_each_time(
    database_url: str, schema: str, position: int
) -> None:
    """Versions written by hand: k1 queued at 1, gone at 5, queued again at 8; k2 queued at 7.
    Read both ways: back from the view now, and (a view far ahead) forward from the start."""
    import json

    def row(key: str, seq: int) -> str:
        return json.dumps({"lease_id": key, "pool": "p1", "tenant": "alpha",
                           "priority_class": "standard", "state": "queued", "shape": {},
                           "attempts": seq, "requested_at": 1.0, "queued_at": 1.0,
                           "last_seq": seq})

    versions = [("k1", 1, "c", row("k1", 1)), ("k1", 5, "d", None), ("k1", 8, "c", row("k1", 8)),
                ("k2", 7, "c", row("k2", 7))]
    with psycopg.connect(database_url) as conn:
        pv.create_schema(conn, schema)
        for key, seq, kind, data in versions:
            conn.execute(f'INSERT INTO "{schema}".history VALUES (%s, %s, %s, %s, %s)',
                         ("queue", key, seq, kind, data))
        for key, seq, _kind, data in versions[2:]:
            conn.execute(f'INSERT INTO "{schema}".queue SELECT * FROM jsonb_populate_record('
                         f'NULL::"{schema}".queue, %s::jsonb)', (data,))
        conn.execute(f'UPDATE "{schema}".tracking SET notification_id = %s', (position,))
        for second, seq in ((100, 3), (101, 6), (102, 9)):
            conn.execute(f'INSERT INTO "{schema}".event_times VALUES (%s, %s, %s)',
                         (second, seq, second + 0.5))
        conn.commit()

        def shown(at: float) -> list[tuple[object, object]]:
            page = query(conn, "queue", tenant=None, schema=schema, at=at)
            return [(r["lease_id"], r["attempts"]) for r in page["rows"]]

        assert shown(100.9) == [("k1", 1)]
        assert shown(101.9) == []
        assert shown(102.9) == [("k1", 8), ("k2", 7)]


@pytest.mark.parametrize("position", [9, 100], ids=["from-the-view-now", "from-the-start"])
def test_pruned_past_answers_the_same_after_the_cut_and_refuses_before_it(
    database_url: str, schema: str, position: int
) -> None:
    """Versions written by hand (k1 queued at 1, changed at 3, gone at 5, back at 8; k3 queued
    at 2 and never changed; k2 queued at 7), pruned a version at a time with a retention that
    cuts at event 6: every time from the cut on reads as before; a time before it is refused
    with a typed error naming the retention, not answered from what is left."""
    import json

    from projections.errors import BeforeHistory
    from projections.views.retention import prune_history

    def row(key: str, seq: int) -> str:
        return json.dumps({"lease_id": key, "pool": "p1", "tenant": "alpha",
                           "priority_class": "standard", "state": "queued", "shape": {},
                           "attempts": seq, "requested_at": 1.0, "queued_at": 1.0,
                           "last_seq": seq})

    versions = [("k1", 1, "c", row("k1", 1)), ("k3", 2, "c", row("k3", 2)),
                ("k1", 3, "u", row("k1", 3)), ("k1", 5, "d", None),
                ("k2", 7, "c", row("k2", 7)), ("k1", 8, "c", row("k1", 8))]
    with psycopg.connect(database_url) as conn:
        pv.create_schema(conn, schema)
        for key, seq, kind, data in versions:
            conn.execute(f'INSERT INTO "{schema}".history VALUES (%s, %s, %s, %s, %s)',
                         ("queue", key, seq, kind, data))
        for _key, _seq, _kind, data in (versions[1], versions[4], versions[5]):
            conn.execute(f'INSERT INTO "{schema}".queue SELECT * FROM jsonb_populate_record('
                         f'NULL::"{schema}".queue, %s::jsonb)', (data,))
        conn.execute(f'UPDATE "{schema}".tracking SET notification_id = %s', (position,))
        conn.execute(f'UPDATE "{schema}".history_since SET seq = 0')
        for second, seq in ((99, 2), (100, 3), (101, 6), (102, 9)):
            conn.execute(f'INSERT INTO "{schema}".event_times VALUES (%s, %s, %s)',
                         (second, seq, second + 0.5))
        conn.commit()

        def shown(at: float) -> list[tuple[object, object]]:
            page = query(conn, "queue", tenant=None, schema=schema, at=at)
            return sorted((r["lease_id"], r["attempts"]) for r in page["rows"])

        times = (99.9, 100.9, 101.9, 102.9)
        before = {at: shown(at) for at in times}
        assert before[100.9] == [("k1", 3), ("k3", 2)]
        assert before[101.9] == [("k3", 2)]
        day = 86400.0
        rounds = 0
        while prune_history(conn, schema, ("queue",), now=101.6 + day, max_age_s=day, batch=1):
            conn.commit()
            rounds += 1
            assert rounds < 20
        conn.commit()
        assert rounds > 2  # one version a statement: small batches
        kept = conn.execute(f'SELECT key, seq FROM "{schema}".history ORDER BY seq').fetchall()
        assert kept == [("k3", 2), ("k2", 7), ("k1", 8)]
        for at in (101.9, 102.9):
            assert shown(at) == before[at], at
        for at in (99.9, 100.9):
            with pytest.raises(BeforeHistory, match=r"kept 1 days \(history retention\)"):
                shown(at)


def test_the_projector_prunes_the_past_past_its_retention(
    plane: tuple[ControlPlane, PoolClient, FakeClock], database_url: str, schema: str,
    capsys: pytest.CaptureFixture[str]
) -> None:
    """A projector keeping a second of past, idle two seconds after a lease's story: its
    versions before the cut are gone, the view now reads the same, and `pool queue --at`
    before the cut is refused with the retention named."""
    from workers.bootstrap import application
    from workers.projector import Projector

    cp, _admin, _clock = plane
    with PoolClient(cp.nats_url, "alpha") as alpha:
        alpha.request_lease(lease_body("job-1", cpu_millis=2000, memory_mib=2048))
        _catch_up(cp, database_url, schema)  # a batch apiece: a version of each row apiece
        queued = _pause()
        assert cp.scheduler.cycle().placed == 1
    _catch_up(cp, database_url, schema)
    count = f'SELECT count(*) FROM "{schema}".history'
    with psycopg.connect(database_url, autocommit=True) as conn:
        versions = conn.execute(count).fetchone()[0]  # type: ignore[index]
        time.sleep(1.1)  # the story's events are now past the retention
        proj = Projector(application(cp.nats_url), database_url, schema=schema, history_max_age_s=1.0)
        proj.start()  # its loop prunes once caught up
        try:
            deadline = time.monotonic() + 20
            while (left := conn.execute(count).fetchone()[0]) >= versions:  # type: ignore[index]
                assert time.monotonic() < deadline, f"nothing pruned: {left} versions"
                time.sleep(0.1)
        finally:
            proj.stop()
    assert _view(database_url, schema, "leases", time.time()) == _view(
        database_url, schema, "leases", None)
    db = ["--database-url", database_url, "--schema", schema]
    assert main(["queue", "--at", str(queued), *db, "--json"]) != 0
    out = capsys.readouterr()
    assert "before_history" in out.out + out.err and "history retention" in out.out + out.err
