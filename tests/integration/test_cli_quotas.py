"""`pool admin cohort set`, the quota flags of `pool admin tenant set`, the limits table of
`pool admin pool show` and `pool shares` (asked of the running scheduler), against a live plane."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bus.local.server import NatsServer
from cli.main import main
from workers.plane import ControlPlane


@pytest.fixture()
def served(fresh_nats: NatsServer) -> Iterator[str]:
    cp = ControlPlane(fresh_nats.url, run_scheduler=False).start()
    yield fresh_nats.url
    cp.stop()


@pytest.fixture()
def scheduled(fresh_nats: NatsServer) -> Iterator[str]:
    """A plane running its scheduler, which answers `pool shares` from its memory."""
    cp = ControlPlane(fresh_nats.url, data_plane=False, leader_ttl_seconds=1.0).start()
    yield fresh_nats.url
    cp.stop()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_operator_sets_a_cohort_and_pool_show_prints_every_limit(
        served: str, capsys: pytest.CaptureFixture[str]) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "p", *u, "--max-runtime", "7200",
                "--priority-classes", "batch=0,standard=10",
                "--non-preemptible-classes", "standard")[0] == 0
    assert _run(capsys, "admin", "cohort", "set", "research", "--pool", "p",
                "--nominal", "gpu_count=2", *u)[0] == 0
    rc, _out, err = _run(capsys, "admin", "tenant", "set", "acme", "--pool", "p", *u,
                         "--nominal", "cpu_millis=8000,gpu_count=0", "--cohort", "research",
                         "--borrow-limit", "cpu_millis=4000", "--no-preemptible")
    assert rc == 0, err
    rc, out, _ = _run(capsys, "admin", "pool", "show", "p", *u)
    assert rc == 0
    lines = out.splitlines()
    acme = next(line.split() for line in lines if line.startswith("acme"))
    assert acme == ["acme", "1", "cpu_millis=8000,gpu_count=0", "research", "cpu_millis=4000",
                    "all", "no"]
    research = next(line.split() for line in lines if line.startswith("research"))
    assert research == ["research", "gpu_count=2", "any", "acme"]
    rc, out, _ = _run(capsys, "admin", "pool", "show", "p", *u, "--json")
    config = json.loads(out)["result"]["config"]
    assert config["maximum_runtime_seconds"] == 7200
    assert config["non_preemptible_classes"] == ["standard"]


def test_a_malformed_limit_is_refused_in_one_line_naming_the_flag(
        served: str, capsys: pytest.CaptureFixture[str]) -> None:
    u = ["--nats-url", served]
    rc, _out, err = _run(capsys, "admin", "tenant", "set", "acme", "--pool", "p", *u,
                         "--borrow-limit", "cpu_millis=lots", "--cohort", "c")
    assert rc == 2 and "--borrow-limit" in err and len(err.strip().splitlines()) == 1
    rc, _out, err = _run(capsys, "admin", "tenant", "set", "acme", "--pool", "p", *u,
                         "--lend-limit", "cpu_millis=1")
    assert rc == 2 and "--cohort" in err


def test_pool_shares_prints_weight_share_decayed_usage_and_rank(
        scheduled: str, capsys: pytest.CaptureFixture[str]) -> None:
    u = ["--nats-url", scheduled]
    assert _run(capsys, "admin", "pool", "create", "p", *u, "--fair-share-half-life", "3600")[0] == 0
    for tenant, weight in (("acme", "2"), ("initech", "1")):
        assert _run(capsys, "admin", "tenant", "set", tenant, "--pool", "p", "--weight", weight,
                    *u)[0] == 0
    # the running scheduler answers once its fold has the tenants (it follows the log)
    deadline = time.monotonic() + 20
    while True:
        rc, out, err = _run(capsys, "shares", "p", *u, "--json")
        result: dict[str, Any] = json.loads(out)["result"] if rc == 0 else {}
        tenants = result.get("tenants") or []
        # a new pool's leader is chosen a moment later; until then the answer is marked stale
        if (len(tenants) == 2 and not result.get("stale")) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert rc == 0, err
    reply = json.loads(out)
    assert set(reply) == {"ok", "result"}
    assert set(reply["result"]) >= {"pool_id", "at", "half_life_seconds", "totals", "tenants"}
    assert set(tenants[0]) == {"tenant", "weight", "current_share", "decayed_share", "priority",
                               "decayed_usage", "usage", "rank"}
    assert not result.get("stale")
    rc, out, _ = _run(capsys, "shares", "p", *u)
    assert rc == 0 and "3600 s half-life" in out
    header, *rows = out.splitlines()[1:]
    assert header.split()[:3] == ["RANK", "TENANT", "WEIGHT"]
    assert sorted(r.split()[1:3] for r in rows) == [["acme", "2"], ["initech", "1"]]
    rc, out, _ = _run(capsys, "shares", "p", *u, "--json")
    assert rc == 0 and [t["rank"] for t in json.loads(out)["result"]["tenants"]] == [1, 2]
    rc, _out, err = _run(capsys, "shares", "nowhere", *u)
    assert rc != 0 and "unknown_pool" in err


def test_pool_shares_without_a_running_scheduler_says_so_in_one_line(
        served: str, capsys: pytest.CaptureFixture[str]) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "p", *u)[0] == 0
    rc, _out, err = _run(capsys, "shares", "p", *u, "--timeout", "2")
    assert rc == 1 and "scheduler_unavailable" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = _run(capsys, "shares", "p", *u, "--timeout", "2", "--json")
    assert rc == 1 and json.loads(out)["error"]["code"] == "scheduler_unavailable"


def test_a_lease_says_whether_it_is_preemptible_checkpointable_and_requeued(
        served: str, capsys: pytest.CaptureFixture[str]) -> None:
    u = ["--nats-url", served]
    assert _run(capsys, "admin", "pool", "create", "p", *u,
                "--priority-classes", "batch=0,standard=10",
                "--non-preemptible-classes", "standard")[0] == 0
    # the operator grants the class besides the pool's default (standard)
    assert _run(capsys, "admin", "tenant", "set", "acme", "--pool", "p", *u,
                "--priority-classes", "batch")[0] == 0
    leases = {}
    for key, priority in (("b", "batch"), ("s", "standard")):
        rc, out, err = _run(capsys, "lease", "request", "--tenant", "acme", "--pool", "p",
                            "--cpu-millis", "100", "--memory-mib", "64", "--max-runtime", "60",
                            "--priority", priority, "--key", key, "--checkpointable",
                            "--requeue-on-preemption", "--json", *u)
        assert rc == 0, err
        leases[key] = json.loads(out)["lease"]
    assert leases["b"]["preemptible"] is True and leases["s"]["preemptible"] is False
    assert all(v["checkpointable"] and v["requeue_on_preemption"] for v in leases.values())
