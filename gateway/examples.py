"""The example bodies the OpenAPI document shows, by the name of the schema they are of.
Each one decodes with its Struct (tests/unit/test_api_documents.py), so none can go stale.
"""

from __future__ import annotations

from typing import Any

from gateway.problems import TYPE_BASE

LEASE_ID = "3f2b6c1e-8d4a-5b7e-9c0f-1a2b3c4d5e6f"

# the concept's request: the key may come from the Idempotency-Key header instead
LEASE_CREATE: dict[str, Any] = {
    "pool_id": "p1",
    "shape": {"gpu_count": 1, "gpu_memory_gib_min": 40, "cpu_millis": 8000,
              "memory_mib": 65536},
    "maximum_runtime_seconds": 3600,
}

LEASE: dict[str, Any] = {
    "lease_id": LEASE_ID,
    "tenant": "alpha",
    "pool_id": "p1",
    "state": "reserved",
    "epoch": 1,
    "node_id": "n1",
    "devices": ["GPU-7d1c0b52-94a1-4b0e-8f53-2c9e6d1a0b3f"],
    "priority_class": "standard",
    "preemptible": True,
    "checkpointable": False,
    "requeue_on_preemption": False,
    "shape": {"resources": {"cpu_millis": 8000, "memory_mib": 65536, "gpu_count": 1,
                            "local_disk_gib": 0, "extended": {}},
              "gpu_memory_gib_min": 40, "gpu_model": None, "cpu_arch": None,
              "gpu_partition": "none", "network_egress": "none", "bandwidth_mbps_min": 0,
              "runtime": "container", "region": None, "zone": None, "preferences": []},
    "maximum_runtime_seconds": 3600,
    "requested_at": 1767225600.0,
    "reserved_at": 1767225600.4,
    "reservation_deadline": 1767225660.4,
    "started_at": None,
    "deadline": None,
    "last_heartbeat_at": None,
    "last_checkpoint_at": None,
    "hold_microcredits": 3600000000,
    "attempts": 0,
    "exit_code": None,
    "end_reason": None,
    "rejection_code": None,
    "version": 2,
}

PAGE: dict[str, Any] = {
    "items": [{"lease_id": LEASE_ID, "tenant": "alpha", "pool_id": "p1", "state": "reserved"}],
    "next_cursor": "eyJsZWFzZV9pZCI6ICIzZjJiIn0",
}

# by component name: a request or reply body whose schema is that component shows it
BY_SCHEMA: dict[str, dict[str, Any]] = {"LeaseCreate": LEASE_CREATE, "Lease": LEASE,
                                        "Page": PAGE}


def problem(status: int, code: str, title: str, path: str) -> dict[str, Any]:
    """A problem as the gateway sends it for `code` on `path`."""
    return {"type": TYPE_BASE + code, "title": title, "status": status,
            "detail": code.replace("_", " "), "code": code, "instance": path}
