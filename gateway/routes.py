"""The HTTP routes: each maps a method and path onto one route of workers/routes.ROUTES.
Adds only what HTTP needs; drives the Litestar handlers and the OpenAPI document alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from msgspec import Struct

from gateway.wire import LeaseCreate
from workers.routes import NODE_VERBS
from workers.routes import ROUTES as NATS_ROUTES
from workers.routes import Route as NatsRoute

Reply = Literal["lease", "result", "page", "row", "stream", "principal"]

LEASE_FILTERS = ("state", "pool", "priority_class", "node_id", "name", "label")
QUEUE_FILTERS = ("pool", "priority_class", "state")
_BY_OPERATION = {r.operation: r for r in NATS_ROUTES}
# path parameters by the subject parameter they fill
_SUBJECT_PARAM = {"lease_id": "lease_id", "node_id": "node"}


@dataclass(frozen=True)
class HttpRoute:
    """One HTTP operation on the NATS route named `nats` (its `operation`); `fixed` gives
    subject parameters the path spells out (a view's name, a node verb). `nats` empty: the
    gateway answers it itself (the admin's view reads)."""

    method: Literal["GET", "POST"]
    path: str
    operation_id: str
    summary: str
    nats: str
    reply: Reply = "result"
    status: int = 200
    admin: bool = False
    query: tuple[str, ...] = ()  # filters passed to a view query as they are
    tag: str = "leases"
    fixed: tuple[tuple[str, str], ...] = ()
    doc_body: type[Struct] | None = None  # the body as documented, when HTTP widens it
    numbers: tuple[str, ...] = ()  # a GET's body fields given as numeric query parameters

    @property
    def path_params(self) -> tuple[str, ...]:
        return tuple(p.split("}")[0] for p in self.path.split("{")[1:])

    @property
    def route(self) -> NatsRoute | None:
        return _BY_OPERATION[self.nats] if self.nats else None

    @property
    def body(self) -> type[Struct] | None:
        """The Struct a body is decoded with: the NATS route's (None for reads by query)."""
        r = self.route
        if r is None or self.reply in ("page", "row", "stream", "principal"):
            return None
        return r.struct

    def subject(self, tenant: str, ids: dict[str, str]) -> str:
        r = self.route
        assert r is not None
        params = {"tenant": tenant, **dict(self.fixed)}
        for name, value in ids.items():
            params[_SUBJECT_PARAM.get(name, name)] = value
        return r.subject.format(**{p: params[p] for p in r.params})


_LEASE = "/v1/compute-leases"
_ONE = _LEASE + "/{lease_id}"

_VERBS = ("commit", "heartbeat", "renew", "release", "cancel")


def _camel(verb: str) -> str:
    head, *rest = verb.split("-")
    return head + "".join(w.capitalize() for w in rest)


def _summary(operation: str) -> str:
    return _BY_OPERATION[operation].summary.rstrip(".")


ROUTES: tuple[HttpRoute, ...] = (
    # any token: what `pool login` checks a token with
    HttpRoute("GET", "/v1/whoami", "whoami",
              "Who the bearer token speaks for: a tenant, or the admin", "", "principal",
              tag="auth"),
    HttpRoute("POST", _LEASE, "createComputeLease",
              "Ask a pool for a lease on capacity of a shape (Idempotency-Key: retries are safe)",
              "requestLease", "lease", 201, doc_body=LeaseCreate),
    HttpRoute("GET", _LEASE, "listComputeLeases",
              "The tenant's leases from the leases view, paged with a cursor (?at=SECONDS: as "
              "they were then)",
              "queryView", "page", query=LEASE_FILTERS, fixed=(("view", "leases"),),
              numbers=("at",)),
    HttpRoute("GET", _ONE, "getComputeLease", _summary("getLease"), "getLease", "lease"),
    *(HttpRoute("POST", f"{_ONE}/{verb}", f"{verb}ComputeLease", _summary(f"{verb}Lease"),
                f"{verb}Lease", "lease")
      for verb in _VERBS),
    HttpRoute("GET", _ONE + "/why", "whyComputeLease",
              "Why a lease waits: counts of nodes per failed filter, and tenant-level reasons "
              "(?at=SECONDS: the reason the scheduler recorded at that time)", "whyLease",
              numbers=("at",)),
    HttpRoute("GET", _ONE + "/history", "getComputeLeaseHistory",
              "The lease's flight recorder: every event of it in the log, in order", ""),
    HttpRoute("GET", _ONE + "/events", "streamComputeLeaseEvents",
              "Server-Sent Events: the lease's state changes from its tenant's lease feed "
              "(resumes from Last-Event-ID, the feed sequence)", "replayFeed", "stream"),
    HttpRoute("GET", _ONE + "/logs", "streamComputeLeaseLogs",
              "Server-Sent Events: the job's output as its agent shipped it, to the end stored "
              "(follow=1: until the lease ends; resumes from Last-Event-ID, the stream "
              "sequence)", "replayTelemetry", "stream"),
    HttpRoute("GET", "/v1/queue", "listQueue",
              "The tenant's waiting requests from the queue view (?at=SECONDS: as it was then)",
              "queryView", "page",
              query=QUEUE_FILTERS, fixed=(("view", "queue"),), numbers=("at",)),
    HttpRoute("GET", "/v1/queue/positions", "listQueuePositions",
              "The tenant's waiting requests in queue order, with estimated starts (from each "
              "pool's leading scheduler)", "queuePositions"),
    HttpRoute("GET", "/v1/balance", "getBalance",
              "The tenant's credits: granted, held, spent and available", "queryView", "row",
              tag="credits", fixed=(("view", "balance"),)),
    HttpRoute("GET", "/v1/usage", "getUsage",
              "What the tenant has used, per pool: leases by state, resource-seconds run, "
              "credits charged (folded from its leases view)", "", query=("pool",),
              tag="credits"),
    HttpRoute("GET", "/v1/telemetry", "streamTelemetry",
              "Server-Sent Events: the tenant's telemetry samples (filter by lease, kind; "
              "resumes from Last-Event-ID, the stream sequence)", "replayTelemetry", "stream",
              tag="telemetry"),
    # -- webhooks: the tenant's endpoints for its lease-feed records --------------------------
    HttpRoute("POST", "/v1/webhooks", "addWebhook", _summary("addWebhook"), "addWebhook",
              status=201, tag="webhooks"),
    HttpRoute("GET", "/v1/webhooks", "listWebhooks", _summary("listWebhooks"), "listWebhooks",
              tag="webhooks"),
    HttpRoute("GET", "/v1/webhooks/deliveries", "listWebhookDeliveries",
              _summary("listWebhookDeliveries"), "listWebhookDeliveries", tag="webhooks"),
    HttpRoute("GET", "/v1/webhooks/{endpoint_id}/deliveries", "listWebhookEndpointDeliveries",
              "The state of one endpoint's latest deliveries", "listWebhookDeliveries",
              tag="webhooks"),
    HttpRoute("POST", "/v1/webhooks/{endpoint_id}/delete", "deleteWebhook",
              _summary("deleteWebhook"), "deleteWebhook", tag="webhooks"),
    HttpRoute("POST", "/v1/webhooks/{endpoint_id}/test", "testWebhook", _summary("testWebhook"),
              "testWebhook", tag="webhooks"),
    # -- secrets: sealed outside the log; a job names them, never their values -----------------
    HttpRoute("POST", "/v1/secrets", "setSecret", _summary("setSecret"), "setSecret",
              status=201, tag="secrets"),
    HttpRoute("GET", "/v1/secrets", "listSecrets", _summary("listSecrets"), "listSecrets",
              tag="secrets"),
    HttpRoute("POST", "/v1/secrets/{name}/delete", "deleteSecret", _summary("deleteSecret"),
              "deleteSecret", tag="secrets"),
    # -- admin -----------------------------------------------------------------------------
    HttpRoute("POST", "/v1/admin/pools", "createPool", _summary("adminPoolCreate"),
              "adminPoolCreate", status=201, admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/pools/{pool_id}", "setPool", _summary("adminPoolSet"),
              "adminPoolSet", admin=True, tag="admin"),
    HttpRoute("GET", "/v1/admin/pools/{pool_id}", "showPool", _summary("adminPoolShow"),
              "adminPoolShow", admin=True, tag="admin"),
    HttpRoute("GET", "/v1/admin/pools/{pool_id}/shares", "adminPoolShares",
              _summary("opsPoolShares"), "opsPoolShares", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/pools/{pool_id}/prices", "setPoolPrices",
              _summary("adminPoolPrices"), "adminPoolPrices", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/pools/{pool_id}/images", "setPoolImages",
              _summary("adminPoolImages"), "adminPoolImages", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/tenants", "setTenant", _summary("adminTenantSet"),
              "adminTenantSet", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/cohorts", "setCohort", _summary("adminCohortSet"),
              "adminCohortSet", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/pools/{pool_id}/reservations", "createReservation",
              _summary("adminReservationCreate"), "adminReservationCreate", status=201,
              admin=True, tag="admin"),
    HttpRoute("GET", "/v1/admin/pools/{pool_id}/reservations", "listReservations",
              _summary("adminReservationList"), "adminReservationList", admin=True,
              tag="admin"),
    HttpRoute("POST", "/v1/admin/pools/{pool_id}/reservations/{reservation_id}/delete",
              "deleteReservation", _summary("adminReservationDelete"),
              "adminReservationDelete", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/credits/grants", "grantCredits", _summary("adminCreditsGrant"),
              "adminCreditsGrant", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/secrets/reseal", "resealSecrets",
              _summary("adminSecretsReseal"), "adminSecretsReseal", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/nodes", "registerNode", _summary("adminNodeRegister"),
              "adminNodeRegister", admin=True, tag="admin"),
    HttpRoute("POST", "/v1/admin/nodes/enrollments", "enrollNode", _summary("adminNodeEnroll"),
              "adminNodeEnroll", admin=True, tag="admin"),
    *(HttpRoute("POST", f"/v1/admin/nodes/{{node_id}}/{verb}",
                _camel(verb) + "Node", f"{verb.capitalize()} a node",
                "adminNodeState", admin=True, tag="admin", fixed=(("verb", verb),))
      for verb in NODE_VERBS),
    HttpRoute("GET", "/v1/admin/leases/{lease_id}", "adminGetComputeLease",
              "Any tenant's lease, from the leases view", "", admin=True, tag="admin"),
    HttpRoute("GET", "/v1/admin/leases/{lease_id}/history", "adminGetComputeLeaseHistory",
              "Any tenant's lease's flight recorder", "", admin=True, tag="admin"),
    HttpRoute("GET", "/v1/admin/views/{view}", "readView",
              "A page of any view, every tenant (queue, balance, capacity, leases; ?at=SECONDS: "
              "as it was then)", "", "page", admin=True, query=(
                  "tenant", "pool", "state", "zone", "priority_class", "node_id"),
              numbers=("at",), tag="admin"),
)

# Path parameters that become subject tokens, and what a bad one reads as.
NOT_FOUND_CODE = {"lease_id": "lease_not_found", "pool_id": "unknown_pool",
                  "node_id": "unknown_node", "view": "not_found",
                  "reservation_id": "unknown_reservation", "endpoint_id": "unknown_webhook",
                  "name": "secret_unknown"}
