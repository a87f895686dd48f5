"""What each view offers its readers: key, columns, filters, which are per tenant, page size.

Plain data, no database driver: the CLI builds its flags from it without importing psycopg.
"""

from __future__ import annotations

KEYS = {"queue": "lease_id", "balance": "tenant", "capacity": "node_id", "leases": "lease_id",
        "gangs": "gang_id"}
FILTERS = {
    "queue": ("pool", "priority_class", "state", "lease_id"),
    "balance": (),
    "capacity": ("pool", "state", "zone", "failure_domain", "gpu_model", "node_id"),
    # label: `k=v[,k=v…]`, the leases whose labels hold every pair
    "leases": ("pool", "state", "node_id", "priority_class", "lease_id", "gang_id", "name",
               "label"),
    "gangs": ("pool", "state", "gang_id"),
}
COLUMNS = {
    "queue": ("lease_id", "tenant", "pool", "priority_class", "state", "attempts",
              "requested_at", "queued_at", "shape"),
    "balance": ("tenant", "granted", "held", "spent", "available", "shortfall", "holds"),
    "capacity": ("node_id", "pool", "state", "zone", "failure_domain", "gpu_model",
                 "cpu_millis_allocatable", "cpu_millis_allocated", "memory_mib_allocatable",
                 "memory_mib_allocated", "gpu_count_allocatable", "gpu_count_allocated",
                 "local_disk_gib_allocatable", "local_disk_gib_allocated",
                 "extended_allocatable", "extended_allocated", "allocations",
                 "last_heartbeat_at"),
    "leases": ("lease_id", "tenant", "pool", "state", "node_id", "priority_class", "epoch",
               "attempts", "shape", "requested_at", "reserved_at", "started_at",
               "run_ended_at", "ended_at", "deadline", "hold_microcredits", "credits_held",
               "credits_charged", "credits_released", "credits_shortfall", "end_reason",
               "exit_code", "gang_id", "gang_member", "name", "labels"),
    # one row per gang, its members (member, lease_id, state, node_id) as a JSON list
    "gangs": ("gang_id", "tenant", "pool", "size", "state", "members", "requested_at"),
}
TENANT_VIEWS = ("queue", "balance", "leases", "gangs")
# filters that are no column of their own: how each is matched (projections.queries)
LABEL_FILTER = "label"
MAX_LIMIT = 1000  # rows in one page
