"""The composition root: every object of the plane's roles, built once from one PlaneConfig.
Its roles and who calls it: docs/architecture.md#one-composition-root.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.local.auth import speaks_as_role
from workers.scheduler.checkpoint import EVERY_EVENTS, EVERY_SECONDS

if TYPE_CHECKING:
    from bus.agentbus import ControlLink
    from bus.appends import AppendSignal
    from bus.checkpoints import CheckpointStore
    from bus.lead import LeadDesk
    from bus.leader import LeaderElection
    from bus.service import Service
    from workers.application import PoolApp
    from workers.commands import CommandHandler
    from workers.dispatcher import Dispatcher, Reconciler
    from workers.pool_leaders import PoolLeadership
    from workers.projecting import Projector
    from workers.scheduler import Scheduler
    from workers.secrets.settings import SecretSettings
    from workers.throttle import TenantThrottle
    from workers.webhooks.settings import WebhookSettings
    from workers.webhooks.worker import Deliverer

log = logging.getLogger(__name__)

# requests one command process works on at once: their saves share atomic batches
COMMAND_WORKERS = 64
# the node lane's and the read lane's workers (each lane its own queue group and pool of
# workers: node heartbeats and reports never wait behind tenants' commands or queries)
NODE_WORKERS = 16
READ_WORKERS = 8
# a tenant's reads one process answers at once (waiting included); one more is refused
# (concurrency_limit): a burst of one tenant's queries cannot fill the read lane
READS_PER_TENANT = 4


def app_env(nats_url: str, **extra: str) -> dict[str, str]:
    """The environment that binds the application to the event log at `nats_url`."""
    # cached aggregates are fast-forwarded by reading only the events after their version, so a
    # node or lease with a long history of heartbeats costs one short read, not a full replay
    env = {"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": nats_url,
           "AGGREGATE_CACHE_MAXSIZE": "20000"}
    if speaks_as_role(nats_url):
        env["CREATE_TABLE"] = "no"  # a role's user may not change streams: the operator made them
    return {**env, **extra}


def application(nats_url: str, clock: Callable[[], float] | None = None,
                **env: str) -> PoolApp:
    """An application over the log at `nats_url`: the one way the product makes one."""
    from workers.application import PoolApp

    return PoolApp(env=app_env(nats_url, **env), clock=clock or time.time)


class Role(StrEnum):
    """What a composition builds; `pool serve --role` names them in groups (SERVED)."""

    COMMANDS = "commands"      # the command service's three lanes and their handler
    SCHEDULER = "scheduler"    # placing: the scheduler, its checkpoint, elections, `why`
    DISPATCHER = "dispatcher"  # agent orders and the tenants' lease feed, from the log
    RECONCILER = "reconciler"  # fired deadline timers
    WEBHOOKS = "webhooks"      # tenants' webhooks delivered, beside the timers
    PROJECTOR = "projector"    # the PostgreSQL views (with a database only)
    GATEWAY = "gateway"        # the HTTP API and dashboard (config.gateway)
    LOG = "log"                # an application over the log alone: operator commands, audits
    REPLAY = "replay"          # a scheduler's fold that never places: `pool shares --at`

    @property
    def user(self) -> str:
        """The NATS user (bus.local.auth's role) this role's parts connect as."""
        return _USERS.get(self, "")


_USERS = {Role.COMMANDS: "commands", Role.SCHEDULER: "scheduler", Role.DISPATCHER: "scheduler",
          Role.RECONCILER: "reconciler", Role.WEBHOOKS: "reconciler",
          Role.PROJECTOR: "projector"}
# the roles `pool serve --role NAME` (and `pool up`'s processes) run, by NAME; each name is a
# NATS user of its own (bus.local.auth)
SERVED: dict[str, frozenset[Role]] = {
    "commands": frozenset({Role.COMMANDS}),
    "scheduler": frozenset({Role.SCHEDULER, Role.DISPATCHER}),
    "reconciler": frozenset({Role.RECONCILER, Role.WEBHOOKS}),
    "projector": frozenset({Role.PROJECTOR}),
}
PLANE = frozenset().union(*SERVED.values())
# the parts that act on the data plane: without one (data_plane=False) no agent gets orders
DATA_PLANE = frozenset({Role.DISPATCHER, Role.RECONCILER, Role.WEBHOOKS})


def served(names: Iterable[str], *, data_plane: bool = True) -> frozenset[Role]:
    """The roles behind `--role` names (see SERVED); without the data plane's parts when
    `data_plane` is False (a plane that sends agents no orders and fires no timers)."""
    roles = frozenset().union(*(SERVED[n] for n in names))
    return roles if data_plane else roles - DATA_PLANE


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway's settings: where tenants' NATS users connect, the operator's URL."""

    nats_url: str
    home: Path  # where its token store lives (gateway.tokens.TOKENS_FILE)
    service_url: str = ""
    auth_path: Path | None = None  # the NATS users' auth.json, None: no users
    database_url: str = ""
    views_schema: str = ""
    max_upload_bytes: int | None = None  # None: the gateway's default
    dashboard: bool = True


@dataclass(frozen=True)
class PlaneConfig:
    """Everything a composition is built from (None for a setting: read from the environment
    at build, as the processes of `pool up` and compose.yaml are configured)."""

    nats_url: str
    clock: Callable[[], float] = time.time
    database_url: str | None = None
    # the responders' connection: a user that may publish replies into inboxes only
    responder_url: str | None = None
    # each user's connection (bus.local.auth.PERMISSIONS); nats_url for all without
    role_urls: Mapping[str, str] = field(default_factory=dict)
    # False: the scheduler is built but never run (a test drives its cycles by hand)
    run_scheduler: bool = True
    # `why` answered from a scheduler that is not run (with run_scheduler False)
    serve_why: bool = False
    leader_ttl_seconds: float = 3.0
    pool_leaders: bool = True  # one placer per pool, the pools spread over scheduler processes
    # the scheduler's fold checkpointed every N events or T seconds; None: never
    checkpoint_every: tuple[int, float] | None = (EVERY_EVENTS, EVERY_SECONDS)
    projector_views: tuple[str, ...] | None = None  # None: every view
    views_schema: str | None = None  # None: projections.views.DEFAULT_SCHEMA
    projector_batch_size: int | None = None  # None: projections.views.DEFAULT_BATCH
    history_max_age_s: float | None = None  # None: $POOL_HISTORY_DAYS or its default
    metrics_port: int | None = None  # /metrics served by the runner; None: not served
    metrics_host: str = "127.0.0.1"
    webhooks: WebhookSettings | None = None
    secrets: SecretSettings | None = None
    throttle: TenantThrottle | None = None
    gateway: GatewayConfig | None = None

    def user_urls(self, roles: Iterable[Role]) -> dict[str, str]:
        """Each user's URL for a process running `roles`: a part it does not run (the
        commands' application, always made) connects as one of the roles it does run, since a
        process may hold only its own roles' passwords."""
        mine_users = {r.user for r in roles}
        mine = next((self.role_urls[u] for u in SERVED if u in mine_users
                     and u in self.role_urls), self.nats_url)
        return {u: self.role_urls.get(u, mine) for u in SERVED}


@dataclass(eq=False)
class Composition:
    """What build() made for its roles; a part of a role it was not given is None.
    `workers.plane.ControlPlane` runs it."""

    config: PlaneConfig
    roles: frozenset[Role]
    urls: dict[str, str]
    halt: threading.Event = field(default_factory=threading.Event)  # set: every loop stops
    app: PoolApp | None = None  # the commands' application (any role of the plane)
    log: PoolApp | None = None
    scheduler: Scheduler | None = None
    checkpoint_store: CheckpointStore | None = None
    handler: CommandHandler | None = None
    commands: Service | None = None
    nodes: Service | None = None
    reads: Service | None = None
    link: ControlLink | None = None
    reconciler_link: ControlLink | None = None
    dispatcher: Dispatcher | None = None
    reconciler: Reconciler | None = None
    deliverer: Deliverer | None = None
    projector: Projector | None = None
    scheduler_signal: AppendSignal | None = None
    dispatcher_signal: AppendSignal | None = None
    election: LeaderElection | None = None
    pool_leadership: PoolLeadership | None = None
    desk: LeadDesk | None = None
    gateway: Any = None  # the gateway's ASGI application
    webhook_settings: WebhookSettings | None = None
    secret_settings: SecretSettings | None = None

    @property
    def nats_url(self) -> str:
        return self.config.nats_url

    @property
    def database_url(self) -> str | None:
        return self.config.database_url

    @property
    def responder_url(self) -> str:
        return self.config.responder_url or self.config.nats_url

    @property
    def role_urls(self) -> dict[str, str]:
        return dict(self.config.role_urls)

    @property
    def run_scheduler(self) -> bool:
        """Whether this process runs the scheduler's loop (not a test driving it by hand)."""
        return self.config.run_scheduler and Role.SCHEDULER in self.roles

    @property
    def serve_why(self) -> bool:
        # `why` and queue positions come from a scheduler's memory: a process whose scheduler
        # never runs would answer every lease as not found, so it answers them only when told
        # to (`serve_why`: a test that drives the scheduler's cycles by hand)
        return self.run_scheduler or (self.config.serve_why and Role.SCHEDULER in self.roles)

    @property
    def data_plane(self) -> bool:
        return bool(self.roles & DATA_PLANE)

    @property
    def lanes(self) -> list[Service]:
        """The command services this process runs: nodes, commands, reads (or none)."""
        return [s for s in (self.nodes, self.commands, self.reads) if s is not None]

    def pool_led(self, pool: str, leading: bool) -> None:
        """A pool's leadership came or went: its `why` desk follows, its queue is placed now."""
        if self.desk is not None:
            self.desk.serve(pool, leading)
        if leading and self.scheduler_signal is not None:
            self.scheduler_signal.wake()  # place its queue now, not at the next append

    def close(self) -> None:
        """Close the applications build() made (the runner stops the rest first)."""
        apps = [self.app, self.log, self.reconciler.app if self.reconciler else None]
        for app in {id(a): a for a in apps if a is not None}.values():
            app.close()
        if self.scheduler is not None:
            self.scheduler.close()
            self.scheduler.app.close()


def holder_id() -> str:
    """This process's name in leader elections: host and pid say which process leads."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def build(config: PlaneConfig, roles: Iterable[Role | str]) -> Composition:
    """Every part of `roles`, each made once, its collaborators passed in."""
    wanted = frozenset(Role(r) for r in roles)
    c = Composition(config, wanted, config.user_urls(wanted))
    if wanted & PLANE:
        # the commands' own loop and connection: the fast path answers requests on that loop,
        # and a flood of them must not hold up the scheduler's reads and saves on its loop
        c.app = application(c.urls["commands"], config.clock, NATS_RUNTIME="commands")
    if Role.SCHEDULER in wanted:
        _scheduler(c)
    if wanted & {Role.COMMANDS, Role.WEBHOOKS}:
        _settings(c)
    if Role.COMMANDS in wanted:
        _lanes(c)
    if c.run_scheduler or Role.COMMANDS in wanted:
        from workers.scheduler import tune_gc

        tune_gc()
    if Role.PROJECTOR in wanted and config.database_url:
        _projector(c)
    _data_plane(c)
    if c.run_scheduler:
        _leaders(c)
    if Role.LOG in wanted:
        c.log = application(config.nats_url, config.clock)
    if Role.REPLAY in wanted:
        from workers.scheduler import Scheduler

        c.scheduler = Scheduler(application(config.nats_url), clock=config.clock)
    if Role.GATEWAY in wanted:
        c.gateway = _gateway(config)
    return c


def _scheduler(c: Composition) -> None:
    """The scheduler on its own application, its fold checkpointed when its role's
    credentials give a key."""
    from bus.checkpoints import CheckpointStore, checkpoint_key
    from workers.scheduler import Scheduler
    from workers.scheduler.checkpoint import Checkpointer

    clock, url, every = c.config.clock, c.urls["scheduler"], c.config.checkpoint_every
    c.scheduler = Scheduler(application(url, clock), clock=clock)
    if not (every and c.run_scheduler):
        return
    # signed with a key from its role's credentials; the dispatcher's leader writes it, every
    # scheduler may read it
    key = checkpoint_key(url)
    if key is None:
        log.info("the scheduler connects without a password and POOL_CHECKPOINT_KEY is "
                 "unset: no checkpoint, every start-up replays the whole log")
        return
    c.checkpoint_store = CheckpointStore(url)
    c.scheduler.checkpoints = Checkpointer(
        c.checkpoint_store, key, every_events=every[0], every_seconds=every[1],
        may_write=lambda: c.election is None or c.election.is_leader)


def _settings(c: Composition) -> None:
    from workers.secrets.settings import SecretSettings
    from workers.webhooks.settings import WebhookSettings

    c.webhook_settings = c.config.webhooks or WebhookSettings.from_env()
    c.secret_settings = c.config.secrets or SecretSettings.from_env()


def _lanes(c: Composition) -> None:
    """The command service's three lanes and the handler behind them."""
    from bus.runtime import get_runtime
    from bus.service import Service
    from workers.commands import (
        ADMIN_SUBJECTS,
        COMMAND_SUBJECTS,
        NODE_SUBJECTS,
        QUERY_SUBJECTS,
        READ_SUBJECTS,
        CommandHandler,
    )
    from workers.secrets import desk_for as secret_desk_for
    from workers.throttle import TenantThrottle
    from workers.webhooks import desk_for

    assert c.app is not None and c.webhook_settings is not None
    assert c.secret_settings is not None
    url = c.urls["commands"]
    # three lanes, each a queue group with workers of its own: node agents' reports,
    # tenants' and operators' commands, and reads (queries from the views, with a
    # database; replays of the streams), so a burst of one waits only behind its own
    reads = READ_SUBJECTS + (QUERY_SUBJECTS if c.database_url else [])
    commands = [s for s in COMMAND_SUBJECTS
                if s not in NODE_SUBJECTS and s not in READ_SUBJECTS] + ADMIN_SUBJECTS
    feed_pages = _feed_pages(url)
    handler = c.handler = CommandHandler(
        c.app, database_url=c.database_url, telemetry_pages=_telemetry_pages(url),
        feed_pages=feed_pages,
        webhooks=desk_for(c.app, url, c.webhook_settings, lambda: feed_pages("", end=True)),
        secrets=secret_desk_for(c.app, url, c.secret_settings))
    # on the loop the application's saves run on: a new lease request or a heartbeat that
    # changes nothing is answered there, without a worker thread (handler.fast); every
    # other command goes to its lane's threads
    on = get_runtime(url, "commands").loop
    gate = c.config.throttle or TenantThrottle.from_env()
    c.commands = Service(c.responder_url, commands, handler, fast=handler.fast,
                         queue="pool-commands", threads=COMMAND_WORKERS, loop=on, gate=gate)
    c.nodes = Service(c.responder_url, NODE_SUBJECTS, handler, queue="pool-nodes",
                      threads=NODE_WORKERS, fast=handler.fast, loop=on, name="pool-node")
    c.reads = Service(c.responder_url, reads, handler, queue="pool-reads",
                      threads=READ_WORKERS, loop=on, name="pool-read",
                      per_key=(_tenant_of, READS_PER_TENANT), gate=gate)
    # one count of requests refused for their reply subject, whichever lane took them
    c.nodes.refused = c.reads.refused = c.commands.refused


def _tenant_of(subject: str) -> str:
    """The tenant token of `pool.cmd.<tenant>.…` (the server pinned it to the requester)."""
    return subject.split(".", 3)[2]


def _telemetry_pages(nats_url: str) -> Callable[..., Any]:
    """Pages of each tenant's telemetry stream for its replays, over the process's bus
    runtime."""
    from bus.runtime import get_runtime
    from bus.telemetry_streams import TenantStreams, read_tenant_page

    streams = TenantStreams()

    def pages(tenant: str, filter_subject: str, **kw: Any) -> Any:
        return read_tenant_page(get_runtime(nats_url), streams, tenant, filter_subject, **kw)

    return pages


def _feed_pages(nats_url: str) -> Callable[..., Any]:
    """Pages of the lease feed for tenants' replays, over the process's bus runtime."""
    from bus.feed import last_sequence, read_page
    from bus.runtime import get_runtime

    def pages(tenant: str, *, end: bool = False, **kw: Any) -> Any:
        rt = get_runtime(nats_url)

        async def go() -> Any:
            nc = await rt.connection()
            return await last_sequence(nc) if end else await read_page(nc, tenant, **kw)

        return rt.run(go())

    return pages


def _projector(c: Composition) -> None:
    # imported only here: PostgreSQL's driver is needed only with a database, and the
    # real-GPU check (local/gpucheck.py) runs on machines that have neither
    from projections.views import DEFAULT_BATCH, DEFAULT_SCHEMA, VIEWS
    from workers.projecting import Projector

    cfg = c.config
    assert cfg.database_url
    c.projector = Projector(application(c.urls["projector"]), cfg.database_url,
                            schema=cfg.views_schema or DEFAULT_SCHEMA,
                            batch_size=cfg.projector_batch_size or DEFAULT_BATCH,
                            views=tuple(cfg.projector_views or VIEWS),
                            history_max_age_s=cfg.history_max_age_s)


def _data_plane(c: Composition) -> None:
    """Agent orders and the lease feed (with the scheduler), deadline timers, webhooks, and
    the signals that wake idle workers."""
    from bus.agentbus import ControlLink
    from bus.appends import AppendSignal
    from bus.checkpoints import CheckpointStore, checkpoint_key
    from workers.dispatcher import Dispatcher, Reconciler
    from workers.scheduler.checkpoint import Checkpointer

    cfg, url, every = c.config, c.urls, c.config.checkpoint_every
    if Role.DISPATCHER in c.roles:
        from bus.feed import FeedWriter
        from workers.feed import FeedPublisher

        c.link = ControlLink(url["scheduler"])
        # the dispatcher's fold also feeds the tenants' lease feed
        c.dispatcher = Dispatcher(application(url["scheduler"], cfg.clock), c.link,
                                  feed=FeedPublisher(FeedWriter(url["scheduler"])))
        from bus.local.auth import speaks_as_role

        if not speaks_as_role(url["scheduler"]):
            # a plane that may make streams makes a tenant's telemetry stream before its
            # first job (ADR 024); role users find the operator's
            from bus.telemetry_streams import MadeOnFirstUse

            c.dispatcher.tenant_streams = MadeOnFirstUse(c.link.rt)
        key = (checkpoint_key(url["scheduler"], "dispatcher")
               if c.checkpoint_store is not None else None)
        if key is not None and every is not None:
            # its fold checkpointed as the scheduler's is, under a name and key of its own
            c.dispatcher.checkpoints = Checkpointer(
                CheckpointStore(url["scheduler"], name="dispatcher"), key,
                every_events=every[0], every_seconds=every[1], purpose="dispatcher")
    if Role.RECONCILER in c.roles:
        assert c.app is not None
        c.reconciler_link = ControlLink(url["reconciler"])
        c.reconciler = Reconciler(c.app if url["reconciler"] == url["commands"] else
                                  application(url["reconciler"], cfg.clock), c.reconciler_link)
    if Role.WEBHOOKS in c.roles:
        # tenants' webhooks, delivered beside the timers (workers/webhooks)
        from workers.webhooks import deliverer_for

        assert c.webhook_settings is not None and c.app is not None
        app = (c.reconciler.app if c.reconciler is not None else c.app)
        c.deliverer = deliverer_for(app, url["reconciler"], c.webhook_settings,
                                    holder=holder_id(),
                                    leader_ttl_seconds=cfg.leader_ttl_seconds)
    # idle workers wake when the log stores an event, not on a timer: one signal each
    if c.run_scheduler:
        c.scheduler_signal = AppendSignal(url["scheduler"])
    if c.dispatcher is not None:
        c.dispatcher_signal = AppendSignal(url["scheduler"])


def _leaders(c: Composition) -> None:
    """One active dispatcher by election; with pool leaders, one placer per pool."""
    from bus.lead import LeadDesk
    from bus.leader import LeaderElection
    from workers.pool_leaders import PoolLeadership
    from workers.why import lead_answers

    scheduler, url, ttl = c.scheduler, c.urls["scheduler"], c.config.leader_ttl_seconds
    assert scheduler is not None
    holder = holder_id()
    # one active dispatcher (and `why`) at a time; a standby folds the log and takes over on
    # death
    c.election = LeaderElection(url, name="scheduler", holder_id=holder, ttl_seconds=ttl)
    if c.config.pool_leaders:
        # `why` for a pool another process leads is asked of that process
        c.desk = LeadDesk(url, lead_answers(scheduler))
        # placing: one leader per pool, the pools spread over the scheduler processes (the
        # pools copied first: a copy is atomic under the GIL, while iterating the dict the
        # scheduler's thread adds to could fail)
        c.pool_leadership = PoolLeadership(
            url, holder, lambda: list(scheduler.pools.copy()), ttl_seconds=ttl,
            on_change=c.pool_led, halt=c.halt)


def _gateway(config: PlaneConfig) -> Any:
    """The gateway's ASGI application; its flight recorder reads the log through an
    application made here on first use."""
    from gateway.app import create_app
    from gateway.tokens import TOKENS_FILE, TokenStore
    from gateway.upstream import Settings

    g = config.gateway
    if g is None:
        raise ValueError("the gateway role needs PlaneConfig.gateway")
    settings = Settings(g.nats_url, auth_path=g.auth_path, service_url=g.service_url)
    if g.max_upload_bytes is not None:  # the largest work directory a tenant sends over HTTP
        settings.max_upload_bytes = g.max_upload_bytes
    return create_app(settings, TokenStore(g.home / TOKENS_FILE), database_url=g.database_url,
                      views_schema=g.views_schema, dashboard=g.dashboard, open_log=application)
