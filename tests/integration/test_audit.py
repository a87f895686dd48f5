"""`pool audit credits`: honest data passes; a tampered view row and a tampered debit are named."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator

import psycopg
import pytest

from bus.local.server import NatsServer
from bus.recorders import PlainLogRecorder
from client.api import PoolClient
from domain.account import Account
from domain.resources import LeaseId
from projections import views as pv
from projections.audit import CreditAudit, audit_credits
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, FakeClock]]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    with PoolClient(fresh_nats.url) as admin:
        setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, credits=10**9)
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 5,
                                           "memory_gib_second": 2})["ok"]
        assert admin.admin("node.register", node_body("n1"))["ok"]
    yield cp, clock
    cp.stop()


def run_leases(cp: ControlPlane, clock: FakeClock, tenant: str, n: int) -> list[str]:
    out = []
    with PoolClient(cp.nats_url, tenant) as c:
        for i in range(n):
            lid = c.request_lease(lease_body(f"{tenant}-{i}", cpu_millis=1500))["lease"]["lease_id"]
            assert cp.scheduler.cycle().placed == 1
            assert c.lease(lid, "commit", JOB)["ok"]
            clock.advance(3.2 + i)
            assert c.lease(lid, "release", {"exit_code": 0})["ok"]
            out.append(lid)
    return out


def project(cp: ControlPlane, database_url: str, schema: str) -> None:
    proj = pv.PoolViews(cp.app, database_url, schema=schema)
    proj.setup()
    proj.catch_up()
    proj.close()


def test_the_audit_passes_on_honest_data(
    plane: tuple[ControlPlane, FakeClock], database_url: str, schema: str
) -> None:
    cp, clock = plane
    run_leases(cp, clock, "alpha", 2)
    with PoolClient(cp.nats_url) as admin:  # a price change mid-stream: the new list applies
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 9})["ok"]
    run_leases(cp, clock, "beta", 1)
    project(cp, database_url, schema)
    report = audit_credits(cp.app, database_url=database_url, schema=schema)
    assert report.ok, report.lines()
    assert report.lines()[-1] == "audit ok"
    assert report.tenants["alpha"].spent > 0 and report.tenants["alpha"].held == 0
    versions = {v for s in report.leases.values() for v in s.price_list_versions}
    assert versions == {2, 3}
    beta_only = audit_credits(cp.app, tenant="beta", database_url=database_url, schema=schema)
    assert beta_only.ok and set(beta_only.tenants) == {"beta"}


def test_the_audit_names_a_tampered_balance_row(
    plane: tuple[ControlPlane, FakeClock], database_url: str, schema: str
) -> None:
    cp, clock = plane
    run_leases(cp, clock, "alpha", 1)
    project(cp, database_url, schema)
    with psycopg.connect(database_url) as conn:
        (spent,), = conn.execute(f'SELECT spent FROM "{schema}".balance WHERE tenant = %s',
                                 ("alpha",)).fetchall()
        conn.execute(f'UPDATE "{schema}".balance SET spent = spent - 1 WHERE tenant = %s',
                     ("alpha",))
    report = audit_credits(cp.app, database_url=database_url, schema=schema)
    assert not report.ok
    bad = [d for d in report.discrepancies if d.kind == "balance_view"]
    assert [(d.tenant, d.detail, d.expected, d.found) for d in bad] == [
        ("alpha", "column spent", spent, spent - 1)]
    assert bad[0].seqs == report.tenants["alpha"].seqs
    line = bad[0].line()
    assert "tenant alpha" in line and f"expected {spent}, found {spent - 1}" in line


def test_the_audit_names_a_tampered_debit(
    plane: tuple[ControlPlane, FakeClock], database_url: str, schema: str
) -> None:
    cp, clock = plane
    run_leases(cp, clock, "alpha", 1)
    with PoolClient(cp.nats_url, "alpha") as c:
        lid = c.request_lease(lease_body("overcharged", cpu_millis=1000))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 1
        assert c.lease(lid, "commit", JOB)["ok"]
    clock.advance(4)
    acc = cp.app.repository.get(Account.create_id("alpha"))
    assert isinstance(acc, Account)
    honest = (5 + 2) * 4  # 1 core at 5 and 1 GiB at 2 per second, for 4 s
    acc.settle("forged", LeaseId(lid), honest + 77, clock.now)
    cp.app.save(acc)
    forged_seq = cp.app.recorder.max_notification_id()
    project(cp, database_url, schema)
    report = audit_credits(cp.app, database_url=database_url, schema=schema)
    charges = [d for d in report.discrepancies if d.kind == "charge"]
    assert len(charges) == 1, report.lines()
    d = charges[0]
    assert (d.tenant, d.lease_id, d.expected, d.found) == ("alpha", lid, honest, honest + 77)
    assert d.seqs[-1] == forged_seq and len(d.seqs) == 2  # the hold and the forged settle
    assert not [x for x in report.discrepancies if x.kind == "balance_view"]  # view agrees
    assert report.lines()[-1].startswith("audit FAILED")


def test_pool_audit_credits_cli_exits_1_and_prints_json(
    plane: tuple[ControlPlane, FakeClock], database_url: str, schema: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cli.main import main

    cp, clock = plane
    run_leases(cp, clock, "alpha", 1)
    project(cp, database_url, schema)
    args = ["--nats-url", cp.nats_url, "--database-url", database_url, "--schema", schema]
    assert main(["audit", "credits", *args]) == 0
    assert capsys.readouterr().out.strip().endswith("audit ok")
    with psycopg.connect(database_url) as conn:
        conn.execute(f'UPDATE "{schema}".balance SET granted = 5 WHERE tenant = %s', ("beta",))
    assert main(["audit", "credits", "--json", *args]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["discrepancies"][0]["tenant"] == "beta"
    assert main(["projections", "status", "--json", *args]) == 0
    status = json.loads(capsys.readouterr().out)["result"]["views"]
    assert {s["view"] for s in status} == set(pv.VIEWS) and all(s["lag"] == 0 for s in status)
    assert main(["projections", "rebuild", "balance", *args]) == 0
    capsys.readouterr()
    assert main(["audit", "credits", *args]) == 0
    capsys.readouterr()
    assert main(["balance", "--json", "--database-url", database_url, "--schema", schema]) == 0
    bal = json.loads(capsys.readouterr().out)
    assert bal["ok"] and {r["tenant"] for r in bal["result"]["rows"]} == {"alpha", "beta"}
    assert main(["leases", "--tenant", "alpha", "--database-url", database_url,
                 "--schema", schema]) == 0
    assert "released" in capsys.readouterr().out


def test_the_audit_reports_the_same_from_bulk_records_and_from_notifications(
    plane: tuple[ControlPlane, FakeClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit folds the log's records read in bulk and (a recorder without bulk record
    reads) notifications: one report, discrepancies included, with the balance snapshot taken
    mid-page."""
    cp, clock = plane
    run_leases(cp, clock, "alpha", 2)
    run_leases(cp, clock, "beta", 1)
    acc = cp.app.repository.get(Account.create_id("beta"))
    assert isinstance(acc, Account)
    acc.hold("forged-hold", LeaseId("not-a-uuid"), 5, clock.now)
    acc.settle("forged", LeaseId("not-a-uuid"), 3, clock.now)
    cp.app.save(acc)
    top = cp.app.recorder.max_notification_id() or 0

    app = PoolApp(env=app_env(cp.nats_url))  # a reader that has written nothing (as the CLI's)
    # the plain path (bus.recorders): notifications read page by page, made into records
    plain = types.SimpleNamespace(recorder=PlainLogRecorder(app.recorder), mapper=app.mapper,
                                  repository=app.repository)
    reports = []
    for target in (app, plain):
        run = CreditAudit(target)
        reports.append((run.run(view_position=top // 2).to_dict(), run._snapshot))
    app.close()
    assert reports[0] == reports[1]
    charges = [d for d in reports[0][0]["discrepancies"] if d["kind"] == "charge"]
    assert [(d["lease_id"], d["found"], d["detail"]) for d in charges] == [
        ("not-a-uuid", 3, "no lease in the log")]


def test_the_audit_leaves_its_objects_aged_not_frozen_and_a_callers_frozen_state_frozen(
    plane: tuple[ControlPlane, FakeClock],
) -> None:
    """At the end of the replay the collector is not left a young generation holding the whole
    report (its first collection would walk all of it): the survivors go to the oldest
    generation unscanned, and nothing stays frozen; where the process froze state of its own
    (a projector's), that stays frozen."""
    import gc

    cp, clock = plane
    run_leases(cp, clock, "alpha", 2)
    gc.unfreeze()  # what earlier tests' in-process schedulers froze (a restored checkpoint)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    report = CreditAudit(cp.app).run()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    # the report's objects are in the oldest generation (a first collection since would have
    # left them in the middle one)
    spend = next(iter(report.leases.values()))
    assert any(o is spend.seqs for o in gc.get_objects(generation=2))
    expected = report.to_dict()
    held = [object() for _ in range(10)]  # "a projector's state", frozen by its owner
    gc.freeze()
    try:
        assert CreditAudit(cp.app).run().to_dict() == expected
        assert gc.isenabled() and not any(o is held for o in gc.get_objects())  # still frozen
    finally:
        gc.unfreeze()
    del held
    gc.disable()  # a caller's own pause is left as it is
    try:
        assert CreditAudit(cp.app).run().to_dict() == expected
        assert not gc.isenabled()
    finally:
        gc.enable()
