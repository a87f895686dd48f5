"""`pool pools|nodes|tenants` fold the views' rows into one line per pool, node and tenant."""

from __future__ import annotations

from cli.overview import node_rows, pool_rows, tenant_rows

NODES = [
    {"node_id": "g1", "pool": "gpu", "state": "ready", "cpu_millis_allocatable": 16000,
     "cpu_millis_allocated": 4000, "memory_mib_allocatable": 65536, "memory_mib_allocated": 0,
     "gpu_count_allocatable": 2, "gpu_count_allocated": 1, "allocations": 1,
     "last_heartbeat_at": 995.0},
    {"node_id": "c1", "pool": "cpu", "state": "cordoned", "cpu_millis_allocatable": 8000,
     "cpu_millis_allocated": 0, "memory_mib_allocatable": 16384, "memory_mib_allocated": 0,
     "gpu_count_allocatable": 0, "gpu_count_allocated": 0, "allocations": 0,
     "last_heartbeat_at": None},
]
LEASES = [{"tenant": "acme", "pool": "gpu", "state": "running"},
          {"tenant": "acme", "pool": "gpu", "state": "released"},
          {"tenant": "globex", "pool": "cpu", "state": "queued"}]


def test_a_node_line_shows_free_over_total_and_its_last_heartbeat() -> None:
    rows = {r["node"]: r for r in node_rows(NODES, now=1000.0)}
    assert rows["g1"]["cpu free"] == "12/16 CPU" and rows["g1"]["gpus free"] == "1/2 GPU"
    assert rows["g1"]["memory free"] == "64/64 GiB" and rows["g1"]["last heartbeat"] == "5s ago"
    assert rows["c1"]["gpus free"] == "-" and rows["c1"]["last heartbeat"] == "-"


def test_a_pool_line_counts_its_nodes_by_state_and_its_leases() -> None:
    rows = {r["pool"]: r for r in pool_rows(NODES, [{"pool": "cpu"}], LEASES)}
    assert rows["gpu"]["nodes"] == "ready 1" and rows["gpu"]["active leases"] == 1
    assert rows["cpu"]["nodes"] == "cordoned 1" and rows["cpu"]["waiting"] == 1


def test_a_tenant_line_joins_its_credits_and_its_leases() -> None:
    rows = {r["tenant"]: r for r in tenant_rows([{"tenant": "acme", "available": 5}], LEASES)}
    assert rows["acme"]["available"] == 5 and rows["acme"]["active leases"] == 1
    assert rows["acme"]["ended leases"] == 1 and rows["globex"]["available"] is None
