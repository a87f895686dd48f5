"""`pool report usage` over views folded from a real log: resource-hours, credits, end reasons
and waits, grouped by tenant, pool, GPU model and day."""

from __future__ import annotations

import csv
import io
import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from bus.local.server import NatsServer
from cli.main import main
from client.api import PoolClient
from projections import views as pv
from projections.usage import UsageError, usage_report, usage_report_url
from tests.control_plane import FakeClock, lease_body, node_body, node_report, setup_pool, start
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}
HOUR = 3600.0


@pytest.fixture(scope="module")
def schema(database_url: str) -> Iterator[str]:
    """The module's views schema (the tests only read what `log` folded into it), dropped
    after the module."""
    from projections.views import drop_schema

    name = f"views_{uuid.uuid4().hex[:10]}"
    yield name
    drop_schema(database_url, name)


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory, database_url: str, schema: str
        ) -> Iterator[tuple[float, float]]:
    """alpha runs 2 cores for 20 h from 08:00 UTC (16 h on its first day, 4 on the next),
    beta holds one GPU for an hour and cancels; both folded into `schema`, once for the
    module on a server of its own."""
    server = NatsServer(store_dir=tmp_path_factory.mktemp("usage"), server_name="pool-usage")
    server.start()
    clock = FakeClock()
    cp: ControlPlane = start(server.url, clock)
    admin = PoolClient(server.url)
    try:
        setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0})
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 7})["ok"]
        admin.admin("node.register", node_body("n1", gpu_count=2, gpu_model="h100",
                                               gpu_memory_gib=80))
        t0 = clock()
        with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
            la = a.request_lease(lease_body("cpu", cpu_millis=2000, max_runtime=86_400))
            lb = b.request_lease(lease_body("gpu", gpu_count=1, max_runtime=86_400))
            clock.advance(60)  # both waited a minute
            assert cp.scheduler.cycle().placed == 2
            aid, bid = la["lease"]["lease_id"], lb["lease"]["lease_id"]
            assert a.lease(aid, "commit", JOB)["ok"] and b.lease(bid, "commit", JOB)["ok"]
            clock.advance(HOUR)
            assert b.lease(bid, "cancel", {"reason": "done early"})["ok"]
            assert node_report(cp.nats_url, "n1", bid, "stopped", {"epoch": 1})["ok"]
            clock.advance(19 * HOUR)
            assert a.lease(aid, "release", {"exit_code": 0})["ok"]
        proj = pv.PoolViews(cp.app, database_url, schema=schema)
        proj.setup()
        try:
            proj.catch_up()
        finally:
            proj.close()
        yield t0, clock()
    finally:
        admin.close()
        cp.stop()
        server.stop()


def _by(database_url: str, schema: str, by: str, start: float, end: float) -> dict[str, dict]:  # type: ignore[type-arg]
    rows = usage_report_url(database_url, by=by, start=start, end=end, now=end, schema=schema)
    return {r.key: r.to_dict() for r in rows}


def test_usage_by_tenant_counts_hours_credits_end_reasons_and_waits(
        log: tuple[float, float], database_url: str, schema: str) -> None:
    t0, t1 = log
    got = _by(database_url, schema, "tenant", t0, t1 + 1)
    alpha, beta = got["alpha"], got["beta"]
    assert alpha["cpu_core_hours"] == pytest.approx(2 * 20, rel=1e-3)
    assert alpha["memory_gib_hours"] == pytest.approx(20, rel=1e-3)  # 1 GiB for 20 h
    assert beta["gpu_hours"] == pytest.approx(1.0, rel=1e-3)
    assert alpha["end_reasons"] == {"succeeded": 1}
    assert beta["end_reasons"] == {"cancelled": 1}
    assert alpha["wait_p50_seconds"] == pytest.approx(60) == beta["wait_p99_seconds"]
    with psycopg.connect(database_url) as conn:
        charged = dict(conn.execute(
            f'SELECT tenant, SUM(credits_charged) FROM "{schema}".leases GROUP BY 1').fetchall())
    assert alpha["credits_charged_microcredits"] == charged["alpha"] > 0


def test_usage_by_day_splits_a_run_at_midnight(
        log: tuple[float, float], database_url: str, schema: str) -> None:
    t0, t1 = log
    days = _by(database_url, schema, "day", t0 - 86_400, t1 + 86_400)
    assert [round(d["cpu_core_hours"], 2) for d in days.values()] == [
        round(2 * (16 - 1 / 60) + 1, 2), round(2 * (4 + 1 / 60), 2)]  # + beta's core-hour
    first, second = days
    assert days[first]["leases_started"] == 2 and days[second]["leases_ended"] == 1


def test_usage_by_gpu_model_and_pool(
        log: tuple[float, float], database_url: str, schema: str) -> None:
    t0, t1 = log
    models = _by(database_url, schema, "gpu-model", t0, t1 + 1)
    assert set(models) == {"h100", "none"}
    assert models["h100"]["gpu_hours"] == pytest.approx(1.0, rel=1e-3)
    assert models["none"]["gpu_hours"] == 0
    assert set(_by(database_url, schema, "pool", t0, t1 + 1)) == {"p1"}


def test_a_window_clips_what_it_counts(
        log: tuple[float, float], database_url: str, schema: str) -> None:
    t0, _ = log
    got = _by(database_url, schema, "tenant", t0 + 60 + 10 * HOUR, t0 + 60 + 11 * HOUR)
    assert got["alpha"]["cpu_core_hours"] == pytest.approx(2.0, rel=1e-3)
    assert "beta" not in got  # its run ended before the window


def test_pool_report_usage_prints_json_and_csv(
        log: tuple[float, float], database_url: str, schema: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    t0, t1 = log
    common = ["report", "usage", "--by", "tenant", "--from", str(t0), "--to", str(t1 + 1),
              "--database-url", database_url, "--schema", schema]
    assert main([*common, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["key"] for r in rows] == ["alpha", "beta"]
    assert main([*common, "--csv"]) == 0
    parsed = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert parsed[0]["key"] == "alpha" and float(parsed[0]["cpu_core_hours"]) > 39


def test_a_report_with_a_bad_window_or_grouping_is_refused(
        database_url: str, schema: str, capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(database_url) as conn, pytest.raises(UsageError):
        usage_report(conn, by="colour", start=0, end=1, now=1, schema=schema)
    assert main(["report", "usage", "--from", "yesterday", "--database-url",
                 database_url]) != 0
    assert "--from" in capsys.readouterr().err
    assert main(["report", "usage", "--from", "2026-12-02", "--to", "2026-12-01",
                 "--database-url", database_url]) != 0
    assert "--to" in capsys.readouterr().err
    for bad in ("inf", "nan", "-5"):
        assert main(["report", "usage", "--to", bad, "--database-url", database_url]) != 0
        assert "--to" in capsys.readouterr().err
