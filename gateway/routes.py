"""The HTTP route table: each operation's method, path, command subject and body Struct.

One row per operation drives the Litestar handlers (gateway/app.py) and the OpenAPI document
(gateway/openapi.py) alike; the subjects are the command service's, one-to-one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from msgspec import Struct

from gateway.wire import LeaseCreate
from schemas import v1

Reply = Literal["lease", "result", "page", "row", "stream"]

NODE_VERBS = ("cordon", "drain", "maintenance", "uncordon", "end-maintenance", "lost")
LEASE_FILTERS = ("state", "pool", "priority_class", "node_id")
QUEUE_FILTERS = ("pool", "priority_class", "state")
ADMIN_VIEWS = ("queue", "balance", "capacity", "leases")


@dataclass(frozen=True)
class HttpRoute:
    """One HTTP operation. `subject` is relative to `pool.cmd.<tenant>.` for tenant routes and
    absolute (`pool.admin.…`) for admin ones; `{name}` parts come from the path."""

    method: Literal["GET", "POST"]
    path: str
    operation_id: str
    summary: str
    subject: str
    body: type[Struct] | None = None
    reply: Reply = "result"
    status: int = 200
    admin: bool = False
    query: tuple[str, ...] = ()  # filters passed to a view query as they are
    tag: str = "leases"

    @property
    def path_params(self) -> tuple[str, ...]:
        return tuple(p.split("}")[0] for p in self.path.split("{")[1:])


_LEASE = "/v1/compute-leases"
_ONE = _LEASE + "/{lease_id}"

_VERBS: tuple[tuple[str, type[Struct], str], ...] = (
    ("commit", v1.CommitLease, "Confirm a reserved lease and attach the job to run"),
    ("heartbeat", v1.HeartbeatLease, "Prove the lease holder is alive (the epoch fences)"),
    ("renew", v1.RenewLease, "Extend a lease's deadline within the pool's maximum"),
    ("release", v1.ReleaseLease, "Give the capacity back: the holder is done"),
    ("cancel", v1.CancelLease, "Withdraw a request or stop a lease before it completes"),
)

ROUTES: tuple[HttpRoute, ...] = (
    HttpRoute("POST", _LEASE, "createComputeLease",
              "Ask a pool for a lease on capacity of a shape (Idempotency-Key: retries are safe)",
              "lease.request", LeaseCreate, "lease", 201),
    HttpRoute("GET", _LEASE, "listComputeLeases",
              "The tenant's leases from the leases view, paged with a cursor",
              "query.leases", reply="page", query=LEASE_FILTERS),
    HttpRoute("GET", _ONE, "getComputeLease", "One lease's current state",
              "lease.{lease_id}.get", reply="lease"),
    *(HttpRoute("POST", f"{_ONE}/{verb}", f"{verb}ComputeLease", summary,
                f"lease.{{lease_id}}.{verb}", body, "lease")
      for verb, body, summary in _VERBS),
    HttpRoute("GET", _ONE + "/why", "whyComputeLease",
              "Why a lease waits: counts of nodes per failed filter, and tenant-level reasons",
              "lease.{lease_id}.why"),
    HttpRoute("GET", _ONE + "/events", "streamComputeLeaseEvents",
              "Server-Sent Events: the lease's state at each change (resumes from "
              "Last-Event-ID, the lease's version)", "lease.{lease_id}.get", reply="stream"),
    HttpRoute("GET", "/v1/queue", "listQueue",
              "The tenant's waiting requests from the queue view", "query.queue",
              reply="page", query=QUEUE_FILTERS),
    HttpRoute("GET", "/v1/balance", "getBalance",
              "The tenant's credits: granted, held, spent and available", "query.balance",
              reply="row", tag="credits"),
    HttpRoute("GET", "/v1/telemetry", "streamTelemetry",
              "Server-Sent Events: the tenant's telemetry samples (filter by lease, kind; "
              "resumes from Last-Event-ID, the stream sequence)", "telemetry.replay",
              reply="stream", tag="telemetry"),
    # -- admin -----------------------------------------------------------------------------
    HttpRoute("POST", "/v1/admin/pools", "setPool",
              "Create or change a pool's scheduling policy", "pool.admin.pool.set",
              v1.PoolConfig, admin=True, tag="admin"),
    HttpRoute("GET", "/v1/admin/pools/{pool_id}", "showPool", "Every setting in force for a pool",
              "pool.admin.pool.show", v1.PoolShow, admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/pools/{pool_id}/prices", "setPoolPrices",
              "Replace a pool's price list (micro-credits per second)", "pool.admin.pool.prices",
              v1.PriceListConfig, admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/pools/{pool_id}/images", "setPoolImages",
              "Replace a pool's image policy", "pool.admin.pool.images", v1.ImagePolicyConfig,
              admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/tenants", "setTenant",
              "A tenant's weight and quota in a pool", "pool.admin.tenant.set", v1.TenantConfig,
              admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/credits/grants", "grantCredits",
              "Add micro-credits to a tenant (a repeated transfer id changes nothing)",
              "pool.admin.credits.grant", v1.CreditGrant, admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/nodes", "registerNode", "Register (enroll) a node in a pool",
              "pool.admin.node.register", v1.NodeRegistration, admin=True, tag="admin"),
    *(HttpRoute("POST", f"/v1/admin/nodes/{{node_id}}/{verb}",
                f"{verb.replace('-', '_')}Node", f"{verb.capitalize()} a node",
                f"pool.admin.node.{{node_id}}.{verb}", v1.NodeStateChange, admin=True,
                tag="admin")
      for verb in NODE_VERBS),
    HttpRoute("GET", "/v1/admin/views/{view}", "readView",
              "A page of any view, every tenant (queue, balance, capacity, leases)", "",
              reply="page", admin=True, query=("tenant", "pool", "state", "zone",
                                               "priority_class", "node_id"), tag="admin"),
)

# Path parameters that become subject tokens, and what a bad one reads as.
NOT_FOUND_CODE = {"lease_id": "lease_not_found", "pool_id": "unknown_pool",
                  "node_id": "unknown_node", "view": "not_found"}
