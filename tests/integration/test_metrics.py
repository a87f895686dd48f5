"""Prometheus /metrics on the gateway and a plane process: the text parses with the official
parser, and its queue depth and leases by state are the views' after a scripted load."""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from projections.queries import query_url
from tests.gateway_stack import Stack, gateway_stack, wait_for

SHAPE = {"cpu_millis": 5000, "memory_mib": 1024}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    from projections.views import drop_schema

    schema = "views_metrics_" + uuid.uuid4().hex[:8]
    home: Path = tmp_path_factory.mktemp("metrics")
    try:
        with gateway_stack(home, database_url, schema, metrics_port=0) as s:
            s.schema = schema  # type: ignore[attr-defined]
            yield s
    finally:
        drop_schema(database_url, schema)


def _samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name → labels → value, every sample of every family."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _rows(database_url: str, schema: str, view: str) -> list[dict[str, object]]:
    return list(query_url(database_url, view, tenant=None, limit=1000, schema=schema)["rows"])


def test_metrics_match_the_views_after_a_scripted_load(stack: Stack, database_url: str) -> None:
    schema = stack.schema  # type: ignore[attr-defined]
    # two nodes of 8 cores: two leases of 5 run, the other four wait
    for who, n in (("alpha", 4), ("beta", 2)):
        with stack.client(who) as c:
            for i in range(n):
                r = c.post("/v1/compute-leases",
                           json={"pool_id": "p1", "shape": SHAPE, "maximum_runtime_seconds": 600},
                           headers={"Idempotency-Key": f"metrics-{who}-{i}"})
                assert r.status_code == 201, r.text

    def settled() -> bool:
        leases = _rows(database_url, schema, "leases")
        states = Counter(str(r["state"]) for r in leases)
        return len(leases) == 6 and states["reserved"] == 2 and states["queued"] == 4

    assert wait_for(settled, timeout=20)
    leases = _rows(database_url, schema, "leases")
    queue = _rows(database_url, schema, "queue")

    with stack.client("alpha") as c:
        assert c.get("/metrics").status_code == 403  # a tenant's token does not read them
    assert httpx.get(stack.url + "/metrics").status_code == 401
    with stack.client("admin") as c:
        r = c.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    got = _samples(r.text)

    want_depth = Counter((str(q["pool"]), str(q["tenant"])) for q in queue)
    assert {dict(k)["tenant"]: v for k, v in got["pool_queue_depth"].items()} == \
        {t: float(n) for (_p, t), n in want_depth.items()}
    assert sum(want_depth.values()) == 4
    want_states = Counter((str(x["pool"]), str(x["state"])) for x in leases)
    assert {(dict(k)["pool"], dict(k)["state"]): v for k, v in got["pool_leases"].items()} == \
        {k: float(n) for k, n in want_states.items()}
    assert all(v >= 0 for v in got["pool_queue_oldest_wait_seconds"].values())
    # no lease ids in any label
    ids = {str(x["lease_id"]) for x in leases}
    assert not any(v in ids for series in got.values() for key in series for _n, v in key)
    # the rest of what the issue names is there
    assert got["pool_nodes"] == {(("pool", "p1"), ("state", "ready")): 2.0}
    cpu = (("pool", "p1"), ("resource", "cpu_millis"))
    assert got["pool_capacity_allocatable"][cpu] == 16000
    assert got["pool_capacity_allocated"][cpu] == 10000
    assert got["pool_request_to_reserved_seconds_count"][(("pool", "p1"),)] == 2
    assert got["pool_log_sequence"][()] > 0
    assert set(got["pool_projection_lag_events"]) and \
        all(v >= 0 for v in got["pool_projection_lag_events"].values())
    assert {dict(k)["tenant"] for k in got["pool_credits_spent_microcredits_total"]} == \
        {"alpha", "beta"}

    # the plane process's own endpoint: its scheduler's counters and the log's sequence
    assert stack.plane.metrics is not None
    plane = _samples(httpx.get(stack.plane.metrics.url, timeout=10).text)
    assert plane["pool_scheduler_placements_total"][(("pool", "p1"),)] >= 2
    assert plane["pool_scheduler_request_to_reserved_seconds_count"][(("pool", "p1"),)] >= 2
    assert plane["pool_log_sequence"][()] > 0
    # a refusal is counted by its stable code
    with stack.client("alpha") as c:
        assert c.post("/v1/compute-leases/" + str(uuid.uuid4()) + "/cancel",
                      json={}).status_code == 404
    plane = _samples(httpx.get(stack.plane.metrics.url, timeout=10).text)
    assert plane["pool_command_refusals_total"][(("code", "lease_not_found"),)] >= 1

    # every series the Grafana dashboard draws is one these endpoints serve
    root = Path(__file__).resolve().parents[2]
    dashboard = json.loads((root / "deploy/grafana/dashboards/computepool.json").read_text())
    drawn = {re.sub(r"_(bucket|total)$", "", name) for panel in dashboard["panels"]
             for target in panel["targets"] for name in re.findall(r"\bpool_\w+", target["expr"])}
    served = {f.name for text in (r.text, httpx.get(stack.plane.metrics.url, timeout=10).text)
              for f in text_string_to_metric_families(text)}
    assert drawn and drawn <= served, drawn - served
