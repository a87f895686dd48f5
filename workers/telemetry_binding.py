"""Which nodes held a lease, as its feed says (written by the control plane alone): a telemetry
sample a node published for a lease it never held is left out of the tenant's replay.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

MAX_LEASES = 10_000  # leases whose nodes are remembered; the least recently asked go first


def sample_key(subject: str) -> tuple[str, str]:
    """(node, lease) of `pool.tel.<pool>.<node>.<tenant>.<lease>.<kind>`."""
    parts = subject.split(".")
    return (parts[3], parts[5]) if len(parts) == 7 else ("", "")


class LeaseNodes:
    """`held(tenant, lease, node)`: whether the lease's feed names the node as its placement,
    read once a lease and again when asked about a node not seen yet (a later placement)."""

    def __init__(self, feed_pages: Callable[..., Any], *, max_leases: int = MAX_LEASES) -> None:
        self._feed_pages = feed_pages
        self._max = max_leases
        self._nodes: OrderedDict[tuple[str, str], frozenset[str]] = OrderedDict()
        self._lock = threading.Lock()

    def held(self, tenant: str, lease: str, node: str) -> bool:
        key = (tenant, lease)
        with self._lock:
            nodes = self._nodes.get(key)
            if nodes is not None:
                self._nodes.move_to_end(key)
        if nodes is not None and node in nodes:
            return True
        nodes = self._read(tenant, lease)
        with self._lock:
            self._nodes[key] = nodes
            self._nodes.move_to_end(key)
            while len(self._nodes) > self._max:
                self._nodes.popitem(last=False)
        return node in nodes

    def _read(self, tenant: str, lease: str) -> frozenset[str]:
        nodes: set[str] = set()
        after = 0
        while True:
            page = self._feed_pages(tenant, lease=lease, after_seq=after, limit=500)
            for seq, _subject, data in page.samples:
                after = max(after, int(seq))
                try:
                    record = msgspec.json.decode(data)
                except msgspec.DecodeError:
                    continue
                node = record.get("node_id") if isinstance(record, dict) else None
                if isinstance(node, str) and node:
                    nodes.add(node)
            if page.at_end or not page.samples:
                return frozenset(nodes)

    def keep(self, tenant: str, samples: list[tuple[int, str, bytes]]
             ) -> tuple[list[tuple[int, str, bytes]], int]:
        """The samples whose node held their lease, and how many were left out."""
        verdicts: dict[tuple[str, str], bool] = {}
        kept = []
        for sample in samples:
            key = sample_key(sample[1])
            ok = verdicts.get(key)
            if ok is None:
                ok = verdicts[key] = bool(key[0]) and self.held(tenant, key[1], key[0])
            if ok:
                kept.append(sample)
        return kept, len(samples) - len(kept)
