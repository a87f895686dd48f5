"""One control-plane process: the command service, the scheduler and its `why` answers.
`pool serve` runs it, whole or as one role; the roles: docs/operations.md#scaling-out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Self

from bus.agentbus import ControlLink
from bus.appends import AppendSignal
from bus.checkpoints import CheckpointStore, checkpoint_key
from bus.feed import FeedWriter
from bus.lead import LeadDesk
from bus.leader import LeaderElection
from bus.runtime import get_runtime
from bus.service import Service
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.commands import (
    ADMIN_SUBJECTS,
    COMMAND_SUBJECTS,
    NODE_SUBJECTS,
    QUERY_SUBJECTS,
    READ_SUBJECTS,
    CommandHandler,
)
from workers.dispatcher import Dispatcher, Reconciler, run_loop
from workers.feed import FeedPublisher
from workers.pool_leaders import PoolLeadership
from workers.routes import subscriptions
from workers.scheduler import Scheduler, tune_gc
from workers.scheduler.checkpoint import EVERY_EVENTS, EVERY_SECONDS, Checkpointer
from workers.scheduler.decisions import record_decisions
from workers.throttle import TenantThrottle
from workers.why import lead_answers, why_handler

if TYPE_CHECKING:
    from workers.metrics import MetricsServer
    from workers.projector import Projector
    from workers.secrets.settings import SecretSettings
    from workers.webhooks.settings import WebhookSettings
    from workers.webhooks.worker import Deliverer

log = logging.getLogger(__name__)

# what scheduler processes answer: `why` and queue positions, from their memory (or a pool's
# leader's, when pools are led apart)
SCHEDULER_SUBJECTS = subscriptions(["scheduler"])
ROLES = ("commands", "scheduler", "reconciler", "projector")
# requests one command process works on at once: their saves share atomic batches
COMMAND_WORKERS = 64
# the node lane's and the read lane's workers (each lane its own queue group and pool of
# workers: node heartbeats and reports never wait behind tenants' commands or queries)
NODE_WORKERS = 16
READ_WORKERS = 8
# a tenant's reads one process answers at once (waiting included); one more is refused
# (concurrency_limit): a burst of one tenant's queries cannot fill the read lane
READS_PER_TENANT = 4


def _tenant_of(subject: str) -> str:
    """The tenant token of `pool.cmd.<tenant>.…` (the server pinned it to the requester)."""
    return subject.split(".", 3)[2]
# started planes per NATS URL in this process: they share its bus runtimes, which only the
# last one to stop may close
_live: Counter[str] = Counter()
_live_lock = threading.Lock()


def parse_roles(values: Iterable[str] | None) -> frozenset[str]:
    """`--role` values (repeated, comma-separated, or `all`) as a set of ROLES; None is all."""
    if values is None:
        return frozenset(ROLES)
    roles: set[str] = set()
    for value in values:
        for role in (r.strip() for r in value.split(",")):
            if role == "all":
                roles.update(ROLES)
            elif role in ROLES:
                roles.add(role)
            elif role:
                raise ValueError(f"unknown role {role!r}: choose from {', '.join(ROLES)} or all")
    if not roles:
        raise ValueError(f"no role given: choose from {', '.join(ROLES)} or all")
    return frozenset(roles)


def holder_id() -> str:
    """This process's name in leader elections: host and pid say which process leads."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def holder_pid(holder: str | None) -> int | None:
    """The pid a `holder_id` names, or None for a holder that is not one (an observer's)."""
    parts = (holder or "").rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


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


class ControlPlane:
    """Commands + scheduler on one NATS server (or cluster); `start()` serves, `stop()` drains.

    `roles` (default: all of ROLES) picks what this process runs; see parse_roles."""

    def __init__(self, nats_url: str, *, clock: Callable[[], float] = time.time,
                 run_scheduler: bool = True, leader_ttl_seconds: float = 3.0,
                 database_url: str | None = None, data_plane: bool = True,
                 roles: Iterable[str] | None = None,
                 projector_views: Iterable[str] | None = None,
                 responder_url: str | None = None,
                 role_urls: Mapping[str, str] | None = None,
                 pool_leaders: bool = True,
                 checkpoint_every: tuple[int, float] | None = (EVERY_EVENTS, EVERY_SECONDS),
                 serve_why: bool = False, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1",
                 webhooks: WebhookSettings | None = None,
                 secrets: SecretSettings | None = None) -> None:
        self.roles = parse_roles(roles)
        # /metrics in the Prometheus text format (workers/metrics.py); None: not served
        self.metrics_at = (metrics_host, metrics_port) if metrics_port is not None else None
        self.metrics: MetricsServer | None = None
        self.database_url = database_url
        # the responders' connection: a user that may publish replies into inboxes only
        self.responder_url = responder_url or nats_url
        # each role's connection (its own user, bus.local.auth.PERMISSIONS); nats_url for all
        # without; role users may not create or change streams, the operator made them
        self.role_urls = dict(role_urls or {})
        # a part this process does not run (the commands' application, always made) connects
        # as one of the roles it does run: a process may hold only its own roles' passwords
        mine = next((self.role_urls[r] for r in ROLES if r in self.roles and r in self.role_urls),
                    nats_url)
        url = {r: self.role_urls.get(r, mine) for r in ROLES}
        run_scheduler = run_scheduler and "scheduler" in self.roles
        self.nats_url = nats_url
        # the commands' own loop and connection: the fast path answers requests on that loop,
        # and a flood of them must not hold up the scheduler's reads and saves on its loop
        self.app = PoolApp(env=app_env(url["commands"], NATS_RUNTIME="commands"), clock=clock)
        self.scheduler = Scheduler(PoolApp(env=app_env(url["scheduler"]), clock=clock),
                                   clock=clock)
        self._wire_checkpoints(url, checkpoint_every, run_scheduler)
        self._wire_lanes(url, database_url, webhooks, secrets)
        self.projector: Projector | None = None
        if database_url and "projector" in self.roles:
            # imported only here: PostgreSQL's driver is needed only with a database, and the
            # real-GPU check (local/gpucheck.py) runs on machines that have neither
            from projections.views import VIEWS
            from workers.projector import Projector
            self.projector = Projector(url["projector"], database_url,
                                       views=tuple(projector_views or VIEWS))
        self.run_scheduler = run_scheduler
        # `why` and queue positions come from a scheduler's memory: a process whose scheduler
        # never runs would answer every lease as not found, so it answers them only when told
        # to (`serve_why`: a test that drives the scheduler's cycles by hand)
        self.serve_why = run_scheduler or (bool(serve_why) and "scheduler" in self.roles)
        if run_scheduler or "commands" in self.roles:
            tune_gc()
        self._wire_data_plane(url, clock, data_plane, checkpoint_every, leader_ttl_seconds)
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._why_lock = threading.Lock()
        self.why: Service | None = None
        self._wire_leaders(url, run_scheduler, pool_leaders, leader_ttl_seconds)

    def _wire_checkpoints(self, url: dict[str, str], checkpoint_every: tuple[int, float] | None,
                          run_scheduler: bool) -> None:
        """The scheduler's fold checkpointed, when its role's credentials give a key."""
        # the scheduler's fold checkpointed every N events or T seconds (checkpoint_every;
        # None: never, every start-up replays the whole log), signed with a key from its
        # role's credentials; the dispatcher's leader writes it, every scheduler may read it
        self.checkpoint_store: CheckpointStore | None = None
        key = checkpoint_key(url["scheduler"]) if checkpoint_every and run_scheduler else None
        if key is not None and checkpoint_every is not None:
            self.checkpoint_store = CheckpointStore(url["scheduler"])
            self.scheduler.checkpoints = Checkpointer(
                self.checkpoint_store, key, every_events=checkpoint_every[0],
                every_seconds=checkpoint_every[1],
                may_write=lambda: self.election is None or self.election.is_leader)
        elif checkpoint_every and run_scheduler:
            log.info("the scheduler connects without a password and POOL_CHECKPOINT_KEY is "
                     "unset: no checkpoint, every start-up replays the whole log")

    def _wire_lanes(self, url: dict[str, str], database_url: str | None,
                    webhooks: WebhookSettings | None, secrets: SecretSettings | None) -> None:
        """The command service's three lanes and the handler behind them."""
        # three lanes, each a queue group with workers of its own: node agents' reports,
        # tenants' and operators' commands, and reads (queries from the views, with a
        # database; replays of the streams), so a burst of one waits only behind its own
        reads = READ_SUBJECTS + (QUERY_SUBJECTS if database_url else [])
        commands = [s for s in COMMAND_SUBJECTS
                    if s not in NODE_SUBJECTS and s not in READ_SUBJECTS] + ADMIN_SUBJECTS
        from workers.webhooks import desk_for
        from workers.webhooks.settings import WebhookSettings

        self.webhook_settings = webhooks or WebhookSettings.from_env()
        from workers.secrets import desk_for as secret_desk_for
        from workers.secrets.settings import SecretSettings

        self.secret_settings = secrets or SecretSettings.from_env()
        feed_pages = _feed_pages(url["commands"])
        handler = CommandHandler(self.app, database_url=database_url,
                                 telemetry_pages=_telemetry_pages(url["commands"]),
                                 feed_pages=feed_pages,
                                 webhooks=desk_for(self.app, url["commands"],
                                                   self.webhook_settings,
                                                   lambda: feed_pages("", end=True)),
                                 secrets=secret_desk_for(self.app, url["commands"],
                                                         self.secret_settings))
        # on the loop the application's saves run on: a new lease request or a heartbeat that
        # changes nothing is answered there, without a worker thread (handler.fast); every
        # other command goes to its lane's threads
        self.commands = self.nodes = self.reads = None
        if "commands" in self.roles:
            on = get_runtime(url["commands"], "commands").loop
            self.commands = Service(self.responder_url, commands, handler, fast=handler.fast,
                                    queue="pool-commands", threads=COMMAND_WORKERS, loop=on,
                                    gate=(gate := TenantThrottle.from_env()))
            self.nodes = Service(self.responder_url, NODE_SUBJECTS, handler,
                                 queue="pool-nodes", threads=NODE_WORKERS,
                                 fast=handler.fast, loop=on, name="pool-node")
            self.reads = Service(self.responder_url, reads, handler, queue="pool-reads",
                                 threads=READ_WORKERS, loop=on, name="pool-read",
                                 per_key=(_tenant_of, READS_PER_TENANT), gate=gate)
            # one count of requests refused for their reply subject, whichever lane took them
            self.nodes.refused = self.reads.refused = self.commands.refused

    def _wire_data_plane(self, url: dict[str, str], clock: Callable[[], float], data_plane: bool,
                         checkpoint_every: tuple[int, float] | None,
                         leader_ttl_seconds: float) -> None:
        """Agent orders, the dispatcher and reconciler, deadline timers and webhooks."""
        # the data plane's side: agent orders (with the scheduler) and durable deadline timers
        self.data_plane = data_plane
        self.link = (ControlLink(url["scheduler"])
                     if data_plane and "scheduler" in self.roles else None)
        self.reconciler_link = (ControlLink(url["reconciler"])
                                if data_plane and "reconciler" in self.roles else None)
        # the dispatcher's fold also feeds the tenants' lease feed
        self.dispatcher = (Dispatcher(PoolApp(env=app_env(url["scheduler"]), clock=clock),
                                      self.link, feed=FeedPublisher(FeedWriter(url["scheduler"])))
                           if self.link is not None else None)
        from bus.local.auth import speaks_as_role

        if (self.dispatcher is not None and self.link is not None
                and not speaks_as_role(url["scheduler"])):
            from bus.telemetry_streams import MadeOnFirstUse

            self.dispatcher.tenant_streams = MadeOnFirstUse(self.link.rt)
        dispatcher_key = (checkpoint_key(url["scheduler"], "dispatcher")
                          if self.checkpoint_store is not None else None)
        if (self.dispatcher is not None and dispatcher_key is not None
                and checkpoint_every is not None):
            # its fold checkpointed as the scheduler's is, under a name and key of its own
            self.dispatcher.checkpoints = Checkpointer(
                CheckpointStore(url["scheduler"], name="dispatcher"), dispatcher_key,
                every_events=checkpoint_every[0], every_seconds=checkpoint_every[1],
                purpose="dispatcher")
        self.reconciler = (Reconciler(self.app if url["reconciler"] == url["commands"] else
                                      PoolApp(env=app_env(url["reconciler"]), clock=clock),
                                      self.reconciler_link)
                           if self.reconciler_link is not None else None)
        # tenants' webhooks, delivered beside the timers (workers/webhooks)
        self.deliverer: Deliverer | None = None
        if self.reconciler is not None:
            from workers.webhooks import deliverer_for

            self.deliverer = deliverer_for(self.reconciler.app, url["reconciler"],
                                           self.webhook_settings, holder=holder_id(),
                                           leader_ttl_seconds=leader_ttl_seconds)
        # idle workers wake when the log stores an event, not on a timer: one signal each
        self.scheduler_signal = AppendSignal(url["scheduler"]) if self.run_scheduler else None
        self.dispatcher_signal = (AppendSignal(url["scheduler"]) if self.dispatcher is not None
                                  else None)

    def _wire_leaders(self, url: dict[str, str], run_scheduler: bool, pool_leaders: bool,
                      leader_ttl_seconds: float) -> None:
        """One active dispatcher by election; with pool leaders, one placer per pool."""
        self.election: LeaderElection | None = None
        self.pool_leadership: PoolLeadership | None = None
        self.desk: LeadDesk | None = None
        if run_scheduler:
            holder = holder_id()
            # one active dispatcher (and `why`) at a time; a standby folds the log and takes
            # over on death
            self.election = LeaderElection(url["scheduler"], name="scheduler", holder_id=holder,
                                           ttl_seconds=leader_ttl_seconds)
            if pool_leaders:
                # `why` for a pool another process leads is asked of that process
                self.desk = LeadDesk(url["scheduler"], lead_answers(self.scheduler))
                # placing: one leader per pool, the pools spread over the scheduler processes
                # (the pools copied first: a copy is atomic under the GIL, while iterating the
                # dict the scheduler's thread adds to could fail)
                self.pool_leadership = PoolLeadership(
                    url["scheduler"], holder, lambda: list(self.scheduler.pools.copy()),
                    ttl_seconds=leader_ttl_seconds, on_change=self._pool_led, halt=self._stop)

    def _serve_why(self, leading: bool) -> None:
        # without pool leaders only the active scheduler knows current reasons, so only it
        # answers `why`; with them, every running scheduler process does (see start)
        with self._why_lock:
            if leading and self.why is None:
                self.why = Service(self.responder_url, SCHEDULER_SUBJECTS,
                                   why_handler(self.scheduler, self.desk,
                                               getattr(self, "decisions", None)),
                                   queue="pool-scheduler", threads=2).start()
            elif not leading and self.why is not None:
                self.why.stop()
                self.why = None

    def _pool_led(self, pool: str, leading: bool) -> None:
        if self.desk is not None:
            self.desk.serve(pool, leading)
        if leading and self.scheduler_signal is not None:
            self.scheduler_signal.wake()  # place its queue now, not at the next append

    def _schedule(self) -> None:
        assert self.election is not None
        if self.pool_leadership is not None:
            # every process folds the log; each places only the pools it leads
            self.scheduler.leads = self.pool_leadership.leads
            while not self._stop.is_set():
                self.scheduler.run(self._stop, signal=self.scheduler_signal)
            self._serve_why(False)  # its memory no longer follows the log: the others answer
            return
        while not self._stop.is_set():
            if self.election.is_leader:
                self.scheduler.run(self._stop, until=lambda: not self.election.is_leader,  # type: ignore[union-attr]
                                   signal=self.scheduler_signal)
            else:
                with contextlib.suppress(Exception):  # the bus may be down; keep standing by
                    self.scheduler.catch_up()  # stay warm for a fast takeover
                self._stop.wait(0.2)

    def _dispatch(self) -> None:
        assert self.dispatcher is not None
        while not self._stop.is_set():
            if self.election is not None and not self.election.is_leader:
                self._stop.wait(0.2)  # only the active scheduler's plane sends orders
                continue
            run_loop(self.dispatcher.step, self._stop, name="dispatcher",
                     until=(lambda: self.election is not None and not self.election.is_leader),
                     signal=self.dispatcher_signal)

    def _urls(self) -> set[str]:
        return {self.nats_url, *self.role_urls.values()}

    @property
    def lanes(self) -> list[Service]:
        """The command services this process runs: nodes, commands, reads (or none)."""
        return [s for s in (self.nodes, self.commands, self.reads) if s is not None]

    def start(self) -> Self:
        with _live_lock:
            _live.update(self._urls())
            self._counted = True
        if self.projector is not None:
            self.projector.start()
        if self.metrics_at is not None:
            self.metrics = self._serve_metrics(*self.metrics_at)
        from bus.local.auth import speaks_as_role

        for link, role in ((self.link, "scheduler"), (self.reconciler_link, "reconciler")):
            if link is not None and not speaks_as_role(self.role_urls.get(role, self.nats_url)):
                link.ensure_streams()  # a role's user may not: the operator made them
        if (self.checkpoint_store is not None
                and not speaks_as_role(self.role_urls.get("scheduler", self.nats_url))):
            self.checkpoint_store.ensure()
        # its cycles (run here, or by hand) record changed wait reasons in their own stream
        self.decisions = record_decisions(self.scheduler) if "scheduler" in self.roles else None
        if self.dispatcher is not None:
            self._workers.append(threading.Thread(target=self._dispatch,
                                                  name="pool-dispatcher", daemon=True))
        if self.reconciler is not None:
            self._workers.append(threading.Thread(
                target=run_loop, name="pool-reconciler", daemon=True,
                args=(self.reconciler.step, self._stop),
                kwargs={"idle": 0.0, "name": "reconciler"}))
        for t in self._workers:
            t.start()
        if self.deliverer is not None:
            self.deliverer.start()
        for lane in self.lanes:
            lane.start()
        if not self.serve_why:
            pass  # `why` is answered by the processes that run a scheduler
        elif self.election is None:
            self._serve_why(True)
        else:
            if self.pool_leadership is not None:
                # pools led apart: every scheduler process answers `why`, asking a pool's
                # leader where it is not that leader
                self._serve_why(True)
                self.election.start()
                self.pool_leadership.start()
            else:
                self.election.start(on_change=self._serve_why)
            self._thread = threading.Thread(target=self._schedule, name="pool-scheduler",
                                            daemon=True)
            self._thread.start()
        return self

    def _serve_metrics(self, host: str, port: int) -> MetricsServer:
        from workers.metrics import MetricsServer, registry_for

        def head() -> int | None:
            return self.app.recorder.max_notification_id()

        return MetricsServer(registry_for(log_head=head, database_url=self.database_url),
                             port, host)

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        self._stop.set()
        for signal in (self.scheduler_signal, self.dispatcher_signal):
            if signal is not None:
                signal.close()  # wakes its waiter; drops the interest while the bus answers
        if self._thread is not None:
            self._thread.join(10)
        for t in self._workers:
            t.join(10)
        if self.deliverer is not None:
            self.deliverer.stop()
        for link in (self.link, self.reconciler_link):
            if link is not None:
                link.close()
        if self.election is not None:
            self.election.stop(release=True)
        if self.pool_leadership is not None:
            self.pool_leadership.stop(release=True)
        for lane in self.lanes:
            lane.stop()
        self._serve_why(False)
        if self.desk is not None:
            self.desk.close()
        if self.projector is not None:
            self.projector.stop()
        self.app.close()
        if self.reconciler is not None and self.reconciler.app is not self.app:
            self.reconciler.app.close()
        self.scheduler.close()
        self.scheduler.app.close()
        from bus.runtime import close_runtime

        with _live_lock:
            if getattr(self, "_counted", False):
                _live.subtract(self._urls())
                self._counted = False
            last = [url for url in self._urls() if _live[url] <= 0]
            for url in last:
                del _live[url]
        for url in last:  # the recorders' shared connections go with the last plane on them
            close_runtime(url)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
