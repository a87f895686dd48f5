"""The route table: every subject the control plane answers, sends or documents, in one list.
`ROUTES` drives the command service, the AsyncAPI export and the HTTP gateway; it connects nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

from msgspec import Struct

from bus.subjects import OPS_PREFIX, is_token
from domain.quota import limits_to_dict
from schemas import v1
from schemas.codec import COMMANDS, CommandSpec, decode_with
from schemas.export import Channel
from schemas.feed import FeedReplay
from schemas.session import SessionOpen
from workers import desks
from workers.errors import UnknownSubject

if TYPE_CHECKING:
    from workers.application import PoolApp
    from workers.secrets.desk import SecretDesk
    from workers.webhooks.desk import WebhookDesk

# who answers (or sends) a route: the command responders, the same responders only with a
# database (queries), the scheduler processes, a node agent (orders the plane sends), or nobody
# (telemetry agents publish to a stream), or a stream the plane writes for tenants (the feed)
ServedBy = Literal["commands", "queries", "scheduler", "agent", "stream", "feed"]
Params = Mapping[str, str]


class Context(Protocol):
    """What a handler may use: the application and the readers a service was given."""

    @property
    def app(self) -> PoolApp: ...

    def query_view(self, tenant: str, view: str, q: v1.Query) -> v1.Envelope: ...

    def telemetry_replay(self, tenant: str, q: v1.TelemetryReplay) -> v1.Envelope: ...

    def feed_replay(self, tenant: str, q: FeedReplay) -> v1.Envelope: ...

    def why(self, tenant: str, lease_id: str, at: float | None = None) -> v1.Envelope: ...

    def queue_positions(self, tenant: str) -> v1.Envelope: ...

    def pool_shares(self, pool_id: str) -> v1.Envelope: ...

    # the command service's desks (workers.desks): None where the service has none
    @property
    def webhooks(self) -> WebhookDesk | None: ...

    @property
    def secrets(self) -> SecretDesk | None: ...


Handler = Callable[[Context, Params, Any], v1.Envelope]
# the same answer on the bus's own loop, or None: "run the Handler on a thread instead"
FastHandler = Callable[[Context, Params, Any], Awaitable[v1.Envelope | None]]


@dataclass(frozen=True)
class Route:
    """One subject pattern (`{name}` tokens are parameters), the codec kind of its body, the
    handler that answers it (None: answered or sent elsewhere) and a one-line summary."""

    subject: str
    kind: str
    handler: Handler | None
    summary: str
    operation: str
    served_by: ServedBy = "commands"
    # parameters restricted to a fixed vocabulary (the node verbs); others are any token
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # subscribe through this wider subject instead (admin: one `pool.admin.>`, so a misspelt
    # admin command is answered `unknown_command`, not left to time out)
    subscribe_via: str | None = None
    # answers the common case without a thread (see FastHandler); the handler answers the rest
    fast: FastHandler | None = None
    tokens: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.subject.split(".")))
        if self.kind not in COMMANDS:
            raise ValueError(f"route {self.subject}: no codec kind {self.kind!r}")

    @property
    def spec(self) -> CommandSpec:
        return COMMANDS[self.kind]

    @property
    def struct(self) -> type[Struct]:
        return self.spec.type

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(t[1:-1] for t in self.tokens if t.startswith("{"))

    @property
    def wildcard(self) -> str:
        """The NATS subscription subject: each parameter a `*`."""
        return ".".join("*" if t.startswith("{") else t for t in self.tokens)

    @property
    def replies(self) -> bool:
        return self.served_by in ("commands", "queries", "scheduler")

    def match(self, parts: list[str]) -> dict[str, str] | None:
        """The parameters when `parts` (a subject split on dots) is this route, else None."""
        if len(parts) != len(self.tokens):
            return None
        params: dict[str, str] = {}
        for want, got in zip(self.tokens, parts, strict=True):
            if want.startswith("{"):
                name = want[1:-1]
                allowed = self.choices.get(name)
                if allowed is not None and got not in allowed:
                    return None
                params[name] = got
            elif want != got:
                return None
        return params

    def decode(self, body: bytes) -> Any:
        return decode_with(self.spec, body)


# -- handlers: parse is done, so each is one application call and its reply -------------------


def _lease_reply(lease: Any, app: Any = None) -> v1.Envelope:
    from schemas.convert import gang_view, lease_view

    view = lease_view(lease)
    if app is not None and getattr(lease, "gang", None) is not None:
        view["gang"] = gang_view(app.gang_members(lease))  # every member, its node, devices
    return v1.Envelope.success(lease=view)


def _node_reply(node: Any) -> v1.Envelope:
    return v1.Envelope.success(result={"node_id": node.node_id, "state": str(node.state)})


def _request(ctx: Context, p: Params, cmd: v1.LeaseRequest) -> v1.Envelope:
    from bus import observability

    # the leases keep this command's trace, so placing and starting them join it
    leases = ctx.app.request_leases(p["tenant"], cmd, trace_parent=observability.traceparent())
    return _requested(leases)


async def _request_fast(ctx: Context, p: Params, cmd: v1.LeaseRequest) -> v1.Envelope | None:
    from bus import observability

    # as `_request`, for a new request whose policies are cached; None for everything else
    leases = await ctx.app.request_leases_async(p["tenant"], cmd,
                                                trace_parent=observability.traceparent())
    return None if leases is None else _requested(leases)


def _requested(leases: list[Any]) -> v1.Envelope:
    from schemas.convert import gang_view, lease_view

    if len(leases) == 1 and leases[0].gang is None:
        return _lease_reply(leases[0])
    # many leases: the first in full (with its gang), and every id in order
    view = lease_view(leases[0])
    if leases[0].gang is not None:
        view["gang"] = gang_view(leases)
    return v1.Envelope.success(lease=view,
                               result={"lease_ids": [str(lease.id) for lease in leases]})


def _lease_verb(verb: str) -> Handler:
    def handle(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
        app = ctx.app
        if verb == "get":
            return _lease_reply(app.get(p["tenant"], p["lease_id"]), app)
        if verb == "commit":  # the job's secrets by name and the version it gets, or refused
            cmd = desks.with_secret_versions(ctx, p["tenant"], cmd)
        method: Callable[[str, str, Any], Any] = getattr(app, verb)
        return _lease_reply(method(p["tenant"], p["lease_id"], cmd), app)

    handle.__name__ = f"lease_{verb}"
    return handle


def _why(ctx: Context, p: Params, cmd: v1.WhyLease) -> v1.Envelope:
    return ctx.why(p["tenant"], p["lease_id"], cmd.at)


def _session(ctx: Context, p: Params, cmd: SessionOpen) -> v1.Envelope:
    from bus.subjects import session_subject

    lease = ctx.app.open_session(p["tenant"], p["lease_id"], cmd)
    node = str(lease.node_id)
    return v1.Envelope.success(result={
        "session_id": cmd.session_id, "lease_id": p["lease_id"], "node_id": node,
        "to_node": session_subject(p["tenant"], node, cmd.session_id, "in"),
        "from_node": session_subject(p["tenant"], node, cmd.session_id, "out")})


def _queue_positions(ctx: Context, p: Params, cmd: v1.QueuePositions) -> v1.Envelope:
    return ctx.queue_positions(p["tenant"])


def _pool_shares(ctx: Context, p: Params, cmd: v1.PoolShow) -> v1.Envelope:
    return ctx.pool_shares(cmd.pool_id)


def _query(ctx: Context, p: Params, cmd: v1.Query) -> v1.Envelope:
    return ctx.query_view(p["tenant"], p["view"], cmd)


def _telemetry_replay(ctx: Context, p: Params, cmd: v1.TelemetryReplay) -> v1.Envelope:
    return ctx.telemetry_replay(p["tenant"], cmd)


def _feed_replay(ctx: Context, p: Params, cmd: FeedReplay) -> v1.Envelope:
    return ctx.feed_replay(p["tenant"], cmd)


def _node_stopped(ctx: Context, p: Params, cmd: v1.LeaseStopped) -> v1.Envelope:
    return _lease_reply(ctx.app.confirm_stopped(p["node"], p["lease_id"], cmd))


def _node_started(ctx: Context, p: Params, cmd: v1.JobStarted) -> v1.Envelope:
    return _lease_reply(ctx.app.job_started(p["node"], p["lease_id"], cmd))


def _node_exited(ctx: Context, p: Params, cmd: v1.JobExited) -> v1.Envelope:
    return _lease_reply(ctx.app.job_ended(p["node"], p["lease_id"], epoch=cmd.epoch,
                                          exit_code=cmd.exit_code))


def _node_failed(ctx: Context, p: Params, cmd: v1.JobFailed) -> v1.Envelope:
    return _lease_reply(ctx.app.job_ended(p["node"], p["lease_id"], epoch=cmd.epoch,
                                          failure=cmd.reason))


def _node_register(ctx: Context, p: Params, cmd: v1.NodeRegistration) -> v1.Envelope:
    return _node_reply(ctx.app.register_own_node(p["node"], cmd))


def _node_heartbeat(ctx: Context, p: Params, cmd: v1.NodeHeartbeat) -> v1.Envelope:
    return v1.Envelope.success(result=ctx.app.node_heartbeat(p["node"], cmd))


async def _node_heartbeat_fast(ctx: Context, p: Params,
                               cmd: v1.NodeHeartbeat) -> v1.Envelope | None:
    # as `_node_heartbeat`, for a node (and leases) already cached; None for everything else
    got = await ctx.app.node_heartbeat_async(p["node"], cmd)
    return None if got is None else v1.Envelope.success(result=got)


def _node_offline(ctx: Context, p: Params, cmd: v1.NodeDrain) -> v1.Envelope:
    return _node_reply(ctx.app.node_offline(p["node"], cmd.reason or "agent_stopped"))


def _pool_create(ctx: Context, p: Params, cmd: v1.PoolConfig) -> v1.Envelope:
    ctx.app.create_pool(cmd)
    return v1.Envelope.success(result=ctx.app.pool_settings(cmd.pool_id))


def _pool_set(ctx: Context, p: Params, cmd: v1.PoolPatch) -> v1.Envelope:
    ctx.app.patch_pool(cmd)
    return v1.Envelope.success(result=ctx.app.pool_settings(cmd.pool_id))


def _pool_show(ctx: Context, p: Params, cmd: v1.PoolShow) -> v1.Envelope:
    return v1.Envelope.success(result=ctx.app.pool_settings(cmd.pool_id))


def _pool_prices(ctx: Context, p: Params, cmd: v1.PriceListConfig) -> v1.Envelope:
    ctx.app.set_prices(cmd)
    return v1.Envelope.success(result=ctx.app.pool_settings(cmd.pool_id))


def _pool_images(ctx: Context, p: Params, cmd: v1.ImagePolicyConfig) -> v1.Envelope:
    ctx.app.set_image_policy(cmd)
    return v1.Envelope.success(result=ctx.app.pool_settings(cmd.pool_id))


def _tenant_set(ctx: Context, p: Params, cmd: v1.TenantConfig) -> v1.Envelope:
    from workers.application import WEIGHT_SCALE

    pol = ctx.app.set_tenant(cmd)
    return v1.Envelope.success(result={
        "tenant": pol.tenant_id, "pool_id": pol.pool_id, "weight": pol.weight / WEIGHT_SCALE,
        "quota": limits_to_dict(pol.quota), "cohort": pol.cohort,
        "borrow_limit": limits_to_dict(pol.borrow_limit),
        "lend_limit": limits_to_dict(pol.lend_limit), "preemptible": pol.preemptible})


def _cohort_set(ctx: Context, p: Params, cmd: v1.CohortConfig) -> v1.Envelope:
    cohort = ctx.app.set_cohort(cmd)
    return v1.Envelope.success(result={
        "pool_id": cohort.pool_id, "name": cohort.name,
        "nominal": limits_to_dict(cohort.nominal), "reclaim": cohort.reclaim})


def _reservation_create(ctx: Context, p: Params, cmd: v1.ReservationCreate) -> v1.Envelope:
    r = ctx.app.create_reservation(cmd)
    return v1.Envelope.success(result=r.to_dict(ctx.app.clock()))


def _reservation_delete(ctx: Context, p: Params, cmd: v1.ReservationDelete) -> v1.Envelope:
    r = ctx.app.delete_reservation(cmd)
    return v1.Envelope.success(result=r.to_dict(ctx.app.clock()))


def _reservation_list(ctx: Context, p: Params, cmd: v1.ReservationList) -> v1.Envelope:
    return v1.Envelope.success(result={"pool_id": cmd.pool_id,
                                       "reservations": ctx.app.reservations(cmd)})


def _admin_node_register(ctx: Context, p: Params, cmd: v1.NodeRegistration) -> v1.Envelope:
    return _node_reply(ctx.app.register_node(cmd))


def _admin_node_enroll(ctx: Context, p: Params, cmd: v1.NodeEnrollment) -> v1.Envelope:
    e = ctx.app.enroll_node(cmd)
    return v1.Envelope.success(result={
        "node_id": e.node_id, "pool_id": e.pool_id, "trust_level": e.trust_level,
        "max_gpus": e.max_gpus, "max_cpu_millis": e.max_cpu_millis,
        "max_memory_mib": e.max_memory_mib, "gpu_model": e.gpu_model})


def _admin_node_state(ctx: Context, p: Params, cmd: v1.NodeStateChange) -> v1.Envelope:
    return _node_reply(ctx.app.node_state(p["node"], p["verb"], cmd.reason or ""))


def _credits_grant(ctx: Context, p: Params, cmd: v1.CreditGrant) -> v1.Envelope:
    acc = ctx.app.grant(cmd.tenant, cmd.amount_microcredits, cmd.transfer_id, cmd.reason or "",
                        known_only=True)
    return v1.Envelope.success(result={"tenant": cmd.tenant,
                                       "available_microcredits": acc.available,
                                       "granted_microcredits": acc.granted})


# -- the table ---------------------------------------------------------------------------------

LEASE_VERBS: Final = ("commit", "heartbeat", "renew", "release", "cancel", "get")
NODE_VERBS: Final = ("cordon", "drain", "maintenance", "uncordon", "end-maintenance", "lost")
QUERY_VIEWS: Final = ("queue", "balance", "leases", "gangs")
_LEASE_SUMMARIES: Final = {
    "commit": "Commit a reserved lease and attach its job.",
    "heartbeat": "Heartbeat a lease (fenced by epoch).",
    "renew": "Extend a lease's deadline.",
    "release": "Release a lease's capacity.",
    "cancel": "Cancel a pending or running lease.",
    "get": "Read a lease.",
}
_ADMIN = "pool.admin.>"


def _admin(path: str, kind: str, handler: Handler, summary: str, operation: str,
           **kw: Any) -> Route:
    return Route(f"pool.admin.{path}", kind, handler, summary, operation,
                 subscribe_via=_ADMIN, **kw)


ROUTES: Final[tuple[Route, ...]] = (
    # tenants: `pool.cmd.<tenant>.…` (server permissions pin the tenant token)
    Route("pool.cmd.{tenant}.lease.request", "lease.request", _request,
          "Request a lease on capacity of a resource shape.", "requestLease",
          fast=_request_fast),
    *(Route(f"pool.cmd.{{tenant}}.lease.{{lease_id}}.{verb}", f"lease.{verb}",
            _lease_verb(verb), _LEASE_SUMMARIES[verb], f"{verb}Lease")
      for verb in LEASE_VERBS),
    Route("pool.cmd.{tenant}.lease.{lease_id}.why", "lease.why", _why,
          "Explain why a lease is pending.", "whyLease", served_by="scheduler"),
    Route("pool.cmd.{tenant}.lease.{lease_id}.session", "lease.session", _session,
          "Open an exec or port-forward session into a running lease; its bytes go over"
          " pool.sess.{tenant}.{node}.{session}.in|out, which only that tenant and node may use.",
          "openSession"),
    Route("pool.cmd.{tenant}.queue", "lease.queue", _queue_positions,
          "The tenant's waiting leases: place in the queue and estimated start.",
          "queuePositions", served_by="scheduler"),
    Route("pool.cmd.{tenant}.query.{view}", "query", _query, "Read a projection view.",
          "queryView", served_by="queries"),
    Route("pool.cmd.{tenant}.telemetry.replay", "telemetry.replay", _telemetry_replay,
          "A page of the tenant's own telemetry from the stream (replay without consumers).",
          "replayTelemetry"),
    Route("pool.cmd.{tenant}.feed.replay", "feed.replay", _feed_replay,
          "A page of the tenant's own lease feed from the stream, after a feed sequence.",
          "replayFeed"),
    Route("pool.cmd.{tenant}.webhook.add", "webhook.add", desks.webhook_add,
          "Register a webhook endpoint for the tenant's lease-feed records of some events "
          "(its signing secret is in this reply only).", "addWebhook"),
    Route("pool.cmd.{tenant}.webhook.list", "webhook.list", desks.webhook_list,
          "The tenant's webhook endpoints.", "listWebhooks"),
    Route("pool.cmd.{tenant}.webhook.delete", "webhook.delete", desks.webhook_delete,
          "Delete a webhook endpoint.", "deleteWebhook"),
    Route("pool.cmd.{tenant}.webhook.test", "webhook.test", desks.webhook_test,
          "POST a signed test message to a webhook endpoint now.", "testWebhook"),
    Route("pool.cmd.{tenant}.webhook.deliveries", "webhook.deliveries", desks.webhook_deliveries,
          "The state of the latest webhook deliveries: pending, delivered or failed.",
          "listWebhookDeliveries"),
    Route("pool.cmd.{tenant}.secret.set", "secret.set", desks.secret_set,
          "Store a new version of a secret, sealed outside the log (the reply names its "
          "version, never its value).", "setSecret"),
    Route("pool.cmd.{tenant}.secret.list", "secret.list", desks.secret_list,
          "The tenant's secrets: names, versions and sizes, never values.", "listSecrets"),
    Route("pool.cmd.{tenant}.secret.delete", "secret.delete", desks.secret_delete,
          "Delete a secret and every kept version of it.", "deleteSecret"),
    # node agents report under their own `pool.node.<node>.…` (their credentials allow no other)
    Route("pool.node.{node}.register", "agent.register", _node_register,
          "A node agent registers its capabilities.", "agentRegister"),
    Route("pool.node.{node}.heartbeat", "agent.heartbeat", _node_heartbeat,
          "A node agent reports it is alive, with the leases it runs.", "agentHeartbeat",
          fast=_node_heartbeat_fast),
    Route("pool.node.{node}.offline", "agent.drain", _node_offline,
          "A node agent stopping cleanly: an idle node is lost at once, not at its timeout.",
          "agentOffline"),
    Route("pool.node.{node}.lease.{lease_id}.stopped", "node.stopped", _node_stopped,
          "A node agent confirms a lease's workload is gone, so its capacity can be freed.",
          "confirmLeaseStopped"),
    Route("pool.node.{node}.lease.{lease_id}.started", "node.started", _node_started,
          "A node agent reports a lease's job started.", "jobStarted"),
    Route("pool.node.{node}.lease.{lease_id}.exited", "node.exited", _node_exited,
          "A node agent reports a lease's job exited with its code.", "jobExited"),
    Route("pool.node.{node}.lease.{lease_id}.failed", "node.failed", _node_failed,
          "A node agent reports a lease's job failed to run.", "jobFailed"),
    Route("pool.node.{node}.lease.{lease_id}.secrets", "node.secrets", desks.node_secrets,
          "A node agent fetches the secrets its running lease's job names, for the epoch it "
          "holds (answered into that node's own inbox only).", "fetchLeaseSecrets"),
    # the operator
    _admin("pool.create", "admin.pool", _pool_create,
           "Create a pool (refused with pool_exists if it exists).", "adminPoolCreate"),
    _admin("pool.set", "admin.pool.set", _pool_set,
           "Change only the named settings of a pool (a new pool takes defaults for the rest).",
           "adminPoolSet"),
    _admin("pool.show", "admin.pool.show", _pool_show, "Every setting in force for a pool.",
           "adminPoolShow"),
    _admin("pool.prices", "admin.pool.prices", _pool_prices, "Publish a new price list version.",
           "adminPoolPrices"),
    _admin("pool.images", "admin.pool.images", _pool_images,
           "Replace a pool's image policy (a new version).", "adminPoolImages"),
    _admin("tenant.set", "admin.tenant", _tenant_set,
           "Set a tenant's weight and quota in a pool.", "adminTenantSet"),
    _admin("cohort.set", "admin.cohort", _cohort_set,
           "Create or reconfigure a cohort of tenants in a pool.", "adminCohortSet"),
    _admin("reservation.create", "admin.reservation.create", _reservation_create,
           "Withhold capacity over a window for a tenant, or whole nodes for maintenance.",
           "adminReservationCreate"),
    _admin("reservation.delete", "admin.reservation.delete", _reservation_delete,
           "Withdraw an advance reservation or maintenance window.", "adminReservationDelete"),
    _admin("reservation.list", "admin.reservation.list", _reservation_list,
           "A pool's advance reservations and maintenance windows.", "adminReservationList"),
    _admin("node.register", "agent.register", _admin_node_register,
           "Register or re-register a node.", "adminNodeRegister"),
    _admin("node.enroll", "admin.node.enroll", _admin_node_enroll,
           "Enroll a node: its pool, trust level and the most its agent may claim.",
           "adminNodeEnroll"),
    _admin("credits.grant", "admin.credits.grant", _credits_grant,
           "Grant micro-credits, idempotent by transfer id.", "adminCreditsGrant"),
    _admin("secrets.reseal", "admin.secrets.reseal", desks.secrets_reseal,
           "Seal every tenant's newest secret versions again under the active key.",
           "adminSecretsReseal"),
    _admin("node.{node}.{verb}", "admin.node.state", _admin_node_state,
           "Cordon, drain, put in maintenance or return a node.", "adminNodeState",
           choices={"verb": NODE_VERBS}),
    # the operator's questions for the scheduler processes: outside `pool.admin.>`, whose one
    # subscription is the command service's, so that no two services race to answer one
    Route(f"{OPS_PREFIX}.pool.shares", "admin.pool.show", _pool_shares,
          "Each tenant's weight, current and decayed share and rank in a pool's fair share, "
          "from the memory of the scheduler leading the pool.", "opsPoolShares",
          served_by="scheduler"),
    # what the plane sends to agents (a work queue per node) and what agents stream
    Route("pool.agent.{node}.start", "agent.assign", None,
          "The pool tells an agent to start a lease's job.", "agentStart", served_by="agent"),
    Route("pool.agent.{node}.stop", "agent.revoke", None,
          "The pool tells an agent to stop a lease.", "agentStop", served_by="agent"),
    Route("pool.agent.{node}.preempt", "agent.revoke", None,
          "The pool tells an agent to stop a lease it preempts, within the grace.",
          "agentPreempt", served_by="agent"),
    Route("pool.agent.{node}.session", "agent.session", None,
          "The pool tells the lease's agent to join an exec or port-forward session.",
          "agentSession", served_by="agent"),
    Route("pool.tel.{pool}.{node}.{tenant}.{lease}.{kind}", "telemetry", None,
          "Queue, startup, execution, utilization and failure events from node agents"
          " (the tenant token lets NATS permissions give each tenant only its own leases).",
          "receiveTelemetry", served_by="stream",
          choices={"kind": tuple(v1.TelemetryKind.__args__)}),  # type: ignore[attr-defined]
    Route("pool.feed.{tenant}.lease.{lease_id}", "feed", None,
          "One state change of a tenant's lease, stored in the feed stream; tenants read it"
          " live on pool.feedlive.{tenant}.lease.{lease_id} (with its Nats-Sequence) and"
          " replay it through replayFeed.", "sendFeedRecord", served_by="feed"),
)


def subscriptions(served_by: Iterable[ServedBy], routes: Iterable[Route] = ROUTES) -> list[str]:
    """The subjects a service answering `served_by` routes subscribes to, each once."""
    wanted = set(served_by)
    out: list[str] = []
    for r in routes:
        if r.served_by in wanted:
            s = r.subscribe_via or r.wildcard
            if s not in out:
                out.append(s)
    return out


# what each parameter is, for the AsyncAPI document (a choice list adds its enum)
PARAMETERS: Final[Mapping[str, str]] = {
    "tenant": "Tenant id (a subject token).",
    "lease_id": "Lease id (a subject token).",
    "lease": "Lease id (a subject token).",
    "view": f"Name of a projection view: {', '.join(QUERY_VIEWS)}.",
    "node": "Node id (a subject token).",
    "pool": "Pool id (a subject token).",
    "verb": "Node maintenance verb.",
    "kind": "Telemetry kind.",
}


def asyncapi_channels(routes: Iterable[Route] = ROUTES) -> list[Channel]:
    """The routes as the AsyncAPI export's channels: what the plane receives and sends."""
    out: list[Channel] = []
    for r in routes:
        params: dict[str, dict[str, Any]] = {}
        for name in r.params:
            doc: dict[str, Any] = {"description": PARAMETERS[name]}
            if name in r.choices:
                doc["enum"] = list(r.choices[name])
            params[name] = doc
        out.append(Channel(id=r.operation, address=r.subject, payload=r.struct,
                           operation=r.operation,
                           action="send" if r.served_by in ("agent", "feed") else "receive",
                           summary=r.summary, replies=r.replies, parameters=params))
    return out


class Router:
    """Finds the route of a subject and runs it: decode the body, call the handler."""

    def __init__(self, routes: Iterable[Route] = ROUTES,
                 served_by: Iterable[ServedBy] = ("commands", "queries")) -> None:
        wanted = set(served_by)
        self.routes = tuple(r for r in routes if r.served_by in wanted and r.handler)
        self._by_head: dict[tuple[str, str, int], list[Route]] = {}
        for r in self.routes:
            self._by_head.setdefault(self._head(list(r.tokens)), []).append(r)

    @staticmethod
    def _head(parts: list[str]) -> tuple[str, str, int]:
        return parts[0], parts[1] if len(parts) > 1 else "", len(parts)

    def match(self, subject: str) -> tuple[Route, dict[str, str]]:
        """The route and its parameters; UnknownSubject when none matches or a parameter is
        not a subject token (subjects are as hostile as bodies)."""
        parts = subject.split(".")
        for r in self._by_head.get(self._head(parts), ()):
            params = r.match(parts)
            if params is None:
                continue
            bad = [k for k, v in params.items() if not is_token(v)]
            if bad:
                raise UnknownSubject(f"{bad[0]} in {subject[:200]!r} is not a subject token")
            return r, params
        raise UnknownSubject(f"no command is answered on {subject[:200]}")

    def dispatch(self, ctx: Context, subject: str, body: bytes) -> v1.Envelope:
        """The reply to `body` on `subject`; raises the layers' typed errors on a refusal."""
        route, params = self.match(subject)
        cmd = route.decode(body)
        assert route.handler is not None
        return route.handler(ctx, params, cmd)

    def fast_route(self, subject: str) -> tuple[Route, dict[str, str]] | None:
        """The route and parameters of `subject` when its route has a fast handler."""
        try:
            route, params = self.match(subject)
        except UnknownSubject:
            return None
        return (route, params) if route.fast is not None else None
