"""Stable reason codes for why a request is waiting or was rejected, and their summary record.

Codes are part of the event and API contract: never rename one, only add new ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# --- node state (node_not_ready is the umbrella; filters report the specific state) ---------
NODE_NOT_READY = "node_not_ready"
NODE_CORDONED = "node_cordoned"
NODE_DRAINING = "node_draining"
NODE_MAINTENANCE = "node_maintenance"
NODE_LOST = "node_lost"

# --- static node traits ---------------------------------------------------------------------
ARCH_MISMATCH = "arch_mismatch"
GPU_MODEL_MISMATCH = "gpu_model_mismatch"
INSUFFICIENT_GPU_MEMORY = "insufficient_gpu_memory"
GPU_PARTITION_UNAVAILABLE = "gpu_partition_unavailable"
ISOLATION_UNAVAILABLE = "isolation_unavailable"
NETWORK_UNAVAILABLE = "network_unavailable"
REGION_MISMATCH = "region_mismatch"
ZONE_MISMATCH = "zone_mismatch"

# --- capacity -------------------------------------------------------------------------------
INSUFFICIENT_CPU = "insufficient_cpu"
INSUFFICIENT_MEMORY = "insufficient_memory"
INSUFFICIENT_GPU = "insufficient_gpu"  # whole GPUs and GPU partitions alike
INSUFFICIENT_DISK = "insufficient_disk"
INSUFFICIENT_EXTENDED = "insufficient_extended"  # any other extended dimension

# --- tenant level ---------------------------------------------------------------------------
QUOTA_EXCEEDED = "quota_exceeded"
INSUFFICIENT_CREDITS = "insufficient_credits"
WAITING_FOR_FAIR_SHARE = "waiting_for_fair_share"
WAITING_FOR_PREEMPTION = "waiting_for_preemption"
IMAGE_NOT_ALLOWED = "image_not_allowed"
WAITING_FOR_CAPACITY = "waiting_for_capacity"
# it fits now, but only on capacity held for a blocked request's reservation (backfill)
WAITING_FOR_RESERVATION = "waiting_for_reservation"
WAITING_FOR_RECLAIM = "waiting_for_reclaim"  # borrowers noticed so an owner gets its quota
# its array (`--count N --max-running K`) has K leases reserved or running already
ARRAY_THROTTLED = "array_throttled"

# Node state name → the code a node in that state fails with.
NODE_STATE_REASONS: Mapping[str, str] = {
    "cordoned": NODE_CORDONED,
    "draining": NODE_DRAINING,
    "maintenance": NODE_MAINTENANCE,
    "lost": NODE_LOST,
}

# The order in which NodeTable.filter applies its filters (and lists their counts).
STATE_REASONS: tuple[str, ...] = (NODE_CORDONED, NODE_DRAINING, NODE_MAINTENANCE, NODE_LOST)
STATIC_REASONS: tuple[str, ...] = (
    ARCH_MISMATCH,
    GPU_MODEL_MISMATCH,
    INSUFFICIENT_GPU_MEMORY,
    GPU_PARTITION_UNAVAILABLE,
    ISOLATION_UNAVAILABLE,
    NETWORK_UNAVAILABLE,
    REGION_MISMATCH,
    ZONE_MISMATCH,
)
CAPACITY_REASONS: tuple[str, ...] = (
    INSUFFICIENT_CPU,
    INSUFFICIENT_MEMORY,
    INSUFFICIENT_GPU,
    INSUFFICIENT_DISK,
    INSUFFICIENT_EXTENDED,
)
FILTER_REASONS: tuple[str, ...] = STATE_REASONS + STATIC_REASONS + CAPACITY_REASONS
TENANT_REASONS: tuple[str, ...] = (
    QUOTA_EXCEEDED,
    INSUFFICIENT_CREDITS,
    WAITING_FOR_FAIR_SHARE,
    WAITING_FOR_PREEMPTION,
    IMAGE_NOT_ALLOWED,
    WAITING_FOR_CAPACITY,
    WAITING_FOR_RESERVATION,
    WAITING_FOR_RECLAIM,
)
ALL_REASONS: frozenset[str] = frozenset(FILTER_REASONS + TENANT_REASONS + (NODE_NOT_READY,))


@dataclass(frozen=True)
class WaitReasons:
    """Why a request is not running: per-filter node counts plus tenant-level codes.

    `filters` maps a filter code to how many nodes fail that filter; a node may fail several,
    so the counts need not add up to `nodes_total` (as in HTCondor's better-analyze).
    """

    nodes_total: int
    filters: dict[str, int] = field(default_factory=dict)
    tenant: tuple[str, ...] = ()
    never_satisfiable: bool = False

    def with_tenant(self, codes: Iterable[str]) -> WaitReasons:
        merged = tuple(dict.fromkeys(self.tenant + tuple(codes)))
        return WaitReasons(self.nodes_total, dict(self.filters), merged, self.never_satisfiable)

    def summary(self) -> str:
        """A one-line human rendering, most common node failure first."""
        parts = [f"{n} {code}" for code, n in sorted(self.filters.items(), key=lambda kv: -kv[1])]
        head = f"0/{self.nodes_total} nodes eligible"
        if parts:
            head += ": " + ", ".join(parts)
        if self.tenant:
            head += "; tenant: " + ", ".join(self.tenant)
        if self.never_satisfiable:
            head += " (never satisfiable)"
        return head

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes_total": self.nodes_total,
            "filters": dict(self.filters),
            "tenant": list(self.tenant),
            "never_satisfiable": self.never_satisfiable,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WaitReasons:
        return cls(
            nodes_total=int(d.get("nodes_total", 0)),
            filters={str(k): int(v) for k, v in dict(d.get("filters", {})).items()},
            tenant=tuple(str(c) for c in d.get("tenant", ())),
            never_satisfiable=bool(d.get("never_satisfiable", False)),
        )
