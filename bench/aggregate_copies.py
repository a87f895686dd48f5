"""What a command's read of a cached aggregate costs in copying it: microseconds per copy of
an account with a full transfer window, a node with many allocations and a running lease."""

from __future__ import annotations

import functools
import json
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

from domain import JobSpec, LeaseId, Node, NodeCapabilities, NodeId, PoolId, Resources, TenantId
from domain.account import TRANSFER_WINDOW, Account
from domain.lease import Lease
from domain.resources import Shape


def _copier() -> Callable[[Any], Any]:
    """What the repository copies a cached aggregate with (a deep copy before domain.copies)."""
    import workers.application.repository  # noqa: F401  (what it registers with domain.copies)

    try:
        from domain.copies import copy_aggregate
    except ImportError:
        from copy import deepcopy
        return deepcopy
    return copy_aggregate


def aggregates(allocations: int = 100) -> dict[str, Any]:
    account = Account.open(tenant_id=TenantId("t"), now=0)
    account.grant("g", 10**12, now=0)
    for i in range(TRANSFER_WINDOW):
        account.hold(f"h{i}", LeaseId(f"l{i}"), 1, now=i)
        account.settle(f"s{i}", LeaseId(f"l{i}"), 1, now=i)
    unit = Resources(cpu_millis=10, memory_mib=10)
    node = Node.register(node_id=NodeId("n"), pool_id=PoolId("p"), now=0,
                         capabilities=NodeCapabilities(allocatable=Resources(
                             cpu_millis=10**6, memory_mib=10**6)))
    for i in range(allocations):
        node.allocate(LeaseId(f"l{i}"), unit, now=i)
    lease = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=Shape.build(cpu_millis=10, memory_mib=10),
                          maximum_runtime_seconds=3600, lease_seconds=600,
                          heartbeat_timeout_seconds=30, now=0)
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n"), commit_timeout_seconds=30, hold_microcredits=1)
    lease.commit(3, JobSpec(image="i", command=("true",)))
    for agg in (account, node, lease):
        agg.collect_events()
    return {"account": account, "node": node, "lease": lease}


def run(repeat: int = 7) -> dict[str, float]:
    copy = _copier()
    out = {}
    for name, agg in aggregates().items():
        number = 20 if name == "account" else 2000
        runs = timeit.repeat(functools.partial(copy, agg), number=number, repeat=repeat)
        out[name] = statistics.median(runs) / number * 1e6
    return out


if __name__ == "__main__":
    print(json.dumps({"copier": _copier().__name__, "us_per_copy": run(
        int(sys.argv[1]) if len(sys.argv) > 1 else 7)}))
