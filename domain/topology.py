"""Free capacity per topology domain (a rack, block, NVLink domain, zone, failure domain): what
`pool capacity --by KEY` shows, folded from the nodes' own ledgers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from domain.node import Node, NodeState
from domain.resources import NodeCapabilities

# label keys the operator (or the agent, where it can read them) sets on a node; zone, region
# and failure_domain are node traits of their own
TOPOLOGY_LABELS: tuple[str, ...] = ("rack", "block", "nvlink_domain")
TRAIT_KEYS: tuple[str, ...] = ("zone", "region", "failure_domain")


def domain_of(node: Node, key: str) -> str:
    """The node's value of a topology key, or "-" when it has none."""
    caps = node.capabilities
    if key in TRAIT_KEYS:
        return str(getattr(caps, key))
    return dict(caps.labels).get(key, "-")


def capacity_by(nodes: Iterable[Node], key: str, *, pool: str | None = None
                ) -> list[dict[str, Any]]:
    """One row per value of `key`: nodes (and ready ones), GPUs and CPU allocatable and free,
    and how many ready nodes have every GPU free (what a gang member of a whole node needs)."""
    rows: dict[str, dict[str, Any]] = {}
    for node in nodes:
        if pool is not None and node.pool_id != pool:
            continue
        value = domain_of(node, key)
        row = rows.setdefault(value, {key: value, "nodes": 0, "ready": 0, "gpus": 0,
                                      "gpus_free": 0, "whole_gpu_nodes_free": 0,
                                      "cpu_millis": 0, "cpu_millis_free": 0})
        ready = node.state is NodeState.READY
        alloc, free = node.allocatable, node.free_capacity
        row["nodes"] += 1
        row["ready"] += ready
        row["gpus"] += alloc.gpu_count
        row["cpu_millis"] += alloc.cpu_millis
        if ready:
            row["gpus_free"] += free.gpu_count
            row["cpu_millis_free"] += free.cpu_millis
            row["whole_gpu_nodes_free"] += bool(alloc.gpu_count) and (
                free.gpu_count == alloc.gpu_count)
    return [rows[k] for k in sorted(rows)]


def topology_of(caps: NodeCapabilities) -> dict[str, str]:
    """The node's values of the keys a gang may be packed into or spread over; a label the
    node lacks is left out (a gang packed by it cannot go there)."""
    out = {k: v for k, v in caps.labels if k in TOPOLOGY_LABELS}
    out["zone"] = caps.zone
    out["failure_domain"] = caps.failure_domain
    return out
