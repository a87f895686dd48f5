"""The projections' fast paths give what the plain ones give: read-ahead pages (a pull consumer)
hold the notifications direct gets return, the views' event decoder builds the mapper's events,
and the audit's credit decoding and on-demand folding reach the mapper's report."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.projections import Workload
from bus.local.server import NatsServer
from bus.transcoder import EventDecoder
from client.api import PoolClient
from domain.fold import lean_mutator
from domain.lease import LeaseState
from projections import audit
from projections import views as pv
from projections.audit import CreditAudit
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from tests.integration.test_projections import assert_equal_to_rebuild, rows
from tests.unit.test_domain_lease import running_lease
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A log with every kind of event: pools and price changes, nodes, leases placed, run and
    released (holds one by one and in a batch, settlements with charges), plus a bench workload
    (cancels, releases). Built once for the module on a server of its own: the tests that use
    it only read the log (each into views of its own)."""
    server = NatsServer(store_dir=tmp_path_factory.mktemp("fast-paths"), server_name="pool-fast")
    server.start()
    clock = FakeClock()
    cp = start(server.url, clock)
    with PoolClient(server.url) as admin:
        setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, credits=10**9)
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 5,
                                           "memory_gib_second": 2})["ok"]
        assert admin.admin("node.register", node_body("n1"))["ok"]
    for tenant in ("alpha", "beta"):
        with PoolClient(cp.nats_url, tenant) as c:
            # three placed in one cycle: their holds are one CreditsHeldBatch
            lids = [c.request_lease(lease_body(f"{tenant}-{i}", cpu_millis=1500))["lease"][
                "lease_id"] for i in range(3)]
            assert cp.scheduler.cycle().placed == 3
            for i, lid in enumerate(lids):
                assert c.lease(lid, "commit", JOB)["ok"]
                clock.advance(2.5 + i)
                assert c.lease(lid, "release", {"exit_code": 0})["ok"]
    work = Workload(4, 2, prefix="w-")
    app: PoolApp = cp.app
    app.save(*work.setup()[1:])
    for _ in range(4):
        aggs, _n = work.batch(600)
        app.save(*aggs)
    yield cp
    cp.stop()
    server.stop()


def _direct(recorder: Any, start: int, stop: int) -> list[Any]:
    out: list[Any] = []
    while start <= stop:
        page = recorder.select_notifications(start, 100, stop=stop)
        if not page:
            break
        out += page
        start = page[-1].id + 1
    return out


def test_read_ahead_pages_hold_what_direct_gets_return(plane: ControlPlane) -> None:
    recorder = plane.app.recorder
    top = recorder.max_notification_id() or 0
    assert top > 2000
    for first, stop in ((1, top), (7, top // 2), (top // 3, top)):
        direct = _direct(recorder, first, stop)
        ahead = [n for page in pv.read_pages(recorder, first, 250, stop=stop) for n in page]
        assert ahead == direct
        assert [n.id for n in ahead] == sorted({n.id for n in ahead})
    # the pages came from the bulk reader, which never had to fall back to direct gets
    reader = recorder.__dict__["_log_reader"]
    assert reader.disabled_until == 0.0 and reader.dseq > 0
    # past the end: nothing
    assert recorder.prefetch(top + 1, 100).result() == []


def test_the_views_decoder_builds_the_mappers_events(plane: ControlPlane) -> None:
    app = plane.app
    decode = EventDecoder(app.mapper)
    fallbacks: list[Any] = []

    class Counting:
        def to_domain_event(self, n: Any) -> Any:
            fallbacks.append(n)
            return app.mapper.to_domain_event(n)

    decode.mapper = Counting()
    notifications = _direct(app.recorder, 1, app.recorder.max_notification_id() or 0)
    kinds = set()
    for n in notifications:
        fast, plain = decode(n), app.mapper.to_domain_event(n)
        kinds.add(type(plain).__qualname__)
        assert type(fast) is type(plain)
        assert fast.__dict__ == plain.__dict__
        assert [type(v) for v in fast.__dict__.values()] == [
            type(v) for v in plain.__dict__.values()]
    assert len(kinds) >= 10 and "Account.CreditsSettled" in kinds, kinds
    assert len(fallbacks) < len(notifications) // 10  # the usual event takes the fast way


def test_the_audit_reports_the_same_without_its_fast_paths(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_report = CreditAudit(plane.app).run()
    plain = CreditAudit(plane.app)
    plain._fast = False  # every credit event through the mapper
    monkeypatch.setattr(audit, "_PENDING_LIMIT", 0)  # every other event folded as it comes
    plain_report = plain.run()
    assert fast_report.ok, fast_report.lines()
    assert fast_report.to_dict() == plain_report.to_dict()
    assert any(s.charged > 0 for s in fast_report.leases.values())
    # the holds recorded as one CreditsHeldBatch: each lease's spend names that event
    batches = [n.id for n in plane.app.recorder.select_notifications(start=1, limit=100_000)
               if n.topic.endswith(".CreditsHeldBatch")]
    assert len(batches) == 2
    from_batch = [s for s in fast_report.leases.values() if s.seqs[0] in batches]
    assert len(from_batch) == 6 and all(s.held > 0 and s.charged > 0 for s in from_batch)
    assert all(s.charged == s.expected for s in from_batch)


def test_an_ended_lease_forgotten_by_the_views_is_read_back_when_it_comes_back(
    fresh_nats: NatsServer, database_url: str, schema: str
) -> None:
    app = PoolApp(env=app_env(fresh_nats.url))
    views = pv.PoolViews(app, database_url, schema=schema)
    try:
        views.setup()
        lease = running_lease()
        lease.notice_preemption(20, grace_seconds=15, requeue=False)
        assert lease.confirm_stopped(30) is LeaseState.PREEMPTED  # ended, for now
        app.save(lease)
        views.catch_up()
        assert lease.id not in views.folder.aggregates  # dropped once it ended
        lease.requeue(40)  # the scheduler may still bring a preempted lease back
        app.save(lease)
        views.catch_up()
        (state,), = rows(database_url, schema, "SELECT state FROM {s}.leases")
        assert state == "queued"
        assert [r[0] for r in rows(database_url, schema, "SELECT lease_id FROM {s}.queue")] == [
            str(lease.id)]
        assert_equal_to_rebuild(app, database_url, schema)
    finally:
        views.close()
        app.close()


def test_the_views_fold_builds_the_librarys_aggregates(plane: ControlPlane) -> None:
    """Folder.apply's lean mutate (the @event method called directly) leaves every aggregate
    exactly as the library's own fold of the log does."""
    app = plane.app
    decode = EventDecoder(app.mapper)
    folder = pv.Folder(app)
    notifications = _direct(app.recorder, 1, app.recorder.max_notification_id() or 0)
    events = [decode(n) for n in notifications]
    for event in events:
        folder.apply(event)
    lean = {type(e) for e in events if lean_mutator(type(e)) is not None}
    assert len(lean) >= 5, lean  # the usual event takes the lean way
    assert folder.aggregates
    for oid, agg in folder.aggregates.items():
        plain = app.repository.get(oid)
        assert type(agg) is type(plain)
        assert agg.__dict__ == plain.__dict__, type(agg).__name__


def test_coalesced_batches_equal_event_by_event_application(
    plane: ControlPlane, database_url: str, schema: str
) -> None:
    """Batches of 1000 (each account, lease and node row touched by many events of a batch,
    written once with its final state) give the views event-by-event batches give (a rebuild
    at batch_size=1), positions and counts included."""
    app = plane.app
    top = app.recorder.max_notification_id() or 0
    views = pv.PoolViews(app, database_url, schema=schema)
    try:
        views.setup()
        assert views.catch_up(batch_size=1000) == top
    finally:
        views.close()
    rebuilt = f"{schema}_rebuilt"
    assert pv.rebuild(app, database_url, schema=rebuilt, batch_size=1) == top
    for view in pv.VIEWS:
        assert pv.dump(database_url, schema, view) == pv.dump(database_url, rebuilt, view), view
    assert pv.positions_at(database_url, schema) == pv.positions_at(database_url, rebuilt)
    # the log does hit rows many times per batch: the bench workload's 4 accounts
    (tenants,), = rows(database_url, schema, "SELECT count(*) FROM {s}.balance")
    assert tenants >= 6
    (versions,), = rows(database_url, schema, "SELECT max(version) FROM {s}.balance")
    assert versions > 300
