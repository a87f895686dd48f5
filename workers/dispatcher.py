"""The dispatcher and the reconciler: the control plane's two hands on the data plane.
What each turns into agent commands and timers: docs/architecture.md#the-work-queue-and-the-timers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from bus.agentbus import ControlLink
from bus.headers import HDR_TRACEPARENT
from bus.recorders import log_recorder
from bus.transcoder import EventDecoder
from domain.fold import Fold
from domain.lease import Lease, LeaseState
from domain.node import Node, NodeState
from domain.pool import Pool
from domain.poolconfig import PoolConfig
from domain.reservation import CapacityReservation
from domain.resources import Shape
from schemas import v1
from schemas.codec import encode
from schemas.hostaccess import VolumeMount
from schemas.session import SessionOrder
from workers.feed import FeedPublisher
from workers.pending import LeaseMemory, QueuedLease
from workers.wake import IdleWait, Signal

_REQUESTED: type = Lease.LeaseRequested  # type: ignore[attr-defined]


def _after(workflow: Any) -> Any:
    """The leases a request waits for, from its event's `workflow` (None: none)."""
    return workflow.get("after") if isinstance(workflow, dict) else None

if TYPE_CHECKING:
    from workers.scheduler.checkpoint import Checkpointer

log = logging.getLogger(__name__)

POSITION_KEY = "dispatcher"
# how long the saved position may lag behind the fold while no orders are sent
POSITION_EVERY_S = 0.5
# within a step, a page's timers are armed with later pages' until this many wait or this long
# has passed since the last were armed
TIMERS_BATCH = 500
TIMERS_EVERY_S = 0.25
# a step that keeps finding events ends past this long at a page with no backlog behind it
STEP_MAX_S = 1.0
PAGE = 1000
# Events that only move a deadline later: no timer is re-armed for them. The armed timer fires
# early, finds nothing due, and the reconciler re-arms it at the new deadline — one publish per
# deadline instead of one per heartbeat.
LATER_ONLY = frozenset({"HeartbeatRecorded", "LeaseRenewed", "NodeHeartbeatRecorded",
                        "SessionOpened"})
# Only these aggregates matter here; their topics name their module.
_TOPICS = ("domain.lease", "domain.node", "domain.pool", "domain.reservation")


@dataclass(frozen=True)
class AgentOrder:
    """One command for one node's agent, with the id that makes a re-send a no-op."""

    node_id: str
    verb: str  # start | stop | preempt
    body: bytes
    msg_id: str
    traceparent: str | None = None
    tenant: str = ""  # a start's: its tenant's telemetry stream is made first where it may be


def wire_shape(shape: Shape) -> v1.ResourceShape:
    """The domain shape as the agent reads it (amounts, egress, runtime class)."""
    r = shape.resources
    partitions = sum(n for _, n in r.extended)
    return v1.ResourceShape(
        cpu_millis=r.cpu_millis, memory_mib=r.memory_mib,
        gpu_count=r.gpu_count or partitions, gpu_memory_gib_min=shape.gpu_memory_gib_min,
        gpu_model=shape.gpu_model, gpu_partition=shape.gpu_partition,
        local_disk_gib=r.local_disk_gib,
        network=v1.NetworkSpec(egress=shape.network_egress),  # type: ignore[arg-type]
        runtime=shape.runtime,  # type: ignore[arg-type]
    )


def _mounts(wanted: tuple[tuple[str, str], ...], config: PoolConfig) -> list[VolumeMount]:
    """The job's volumes with the pool's host paths in force now; one the operator has
    withdrawn since the commit is left out, and the agent refuses the job for it."""
    offered = {v.name: v for v in config.volumes}
    return [VolumeMount(name=name, host_path=offered[name].host_path, target=target,
                        read_only=offered[name].read_only)
            for name, target in wanted if name in offered]


def orders_for(event_name: str, lease: Lease, pool: Pool | None) -> list[AgentOrder]:
    """What the node's agent must be told after `event_name` was applied to `lease`."""
    node = lease.node_id
    if node is None:
        return []
    lid = str(lease.id)
    grace = pool.config.preemption.grace_seconds if pool is not None else 30
    trace = getattr(lease, "trace_parent", None)
    if event_name in ("LeaseCommitted", "JobSubmitted") and lease.job is not None \
            and lease.state is LeaseState.RUNNING:
        job = lease.job
        spec = job.spec
        policy: Any = getattr(pool, "image_policy", None) if pool is not None else None
        files = getattr(pool, "config", None) or PoolConfig()
        workdir = None if spec.workdir_digest is None else v1.WorkdirRef(
            digest=spec.workdir_digest, size_bytes=spec.workdir_size_bytes or 0,
            files=spec.workdir_files)
        assignment = v1.LeaseAssignment(
            lease_id=lid, epoch=lease.epoch, shape=wire_shape(lease.requested_shape),
            job=v1.JobSpec(
                image=spec.image or None, command=list(spec.command), env=dict(spec.env),
                image_signature=spec.image_signature, image_size_bytes=spec.image_size_bytes,
                checkpoint_policy=v1.CheckpointPolicy(
                    mode="periodic" if spec.checkpoint_interval_seconds else "none",
                    interval_seconds=spec.checkpoint_interval_seconds),
                workdir=workdir, artifacts=list(spec.artifacts),
                secret_env=dict(spec.secret_env), secret_files=dict(spec.secret_files),
                secret_versions=dict(spec.secret_versions), registry_secret=spec.registry_secret,
                volumes=dict(spec.volumes), stdin=spec.stdin,
            ),
            deadline_at=lease.deadline or 0.0, tenant=lease.tenant_id, pool_id=lease.pool_id,
            job_number=job.number,
            image_policy=policy.to_dict() if hasattr(policy, "to_dict") else None,
            devices=list(getattr(lease, "devices", ())),
            artifact_ttl_seconds=files.artifact_ttl_seconds,
            max_artifact_bytes=files.max_artifact_bytes,
            max_output_bytes=files.max_output_bytes,
            attempt=max(1, int(getattr(lease, "attempts", 1) or 1)),
            array_index=getattr(lease, "array_index", None),
            array_size=getattr(lease, "array_size", 0),
            volumes=_mounts(spec.volumes, files),
            egress_allow=list(files.egress_allow),
        )
        return [AgentOrder(node, "start", encode(assignment),
                           f"start-{lid}-{lease.epoch}-{job.number}-{job.attempts}", trace,
                           lease.tenant_id)]
    if event_name == "StopRequested":
        body = v1.LeaseRevocation(lease_id=lid, epoch=lease.epoch, grace_seconds=grace,
                                  reason=lease.stop_reason or "cancelled")
        return [AgentOrder(node, "stop", encode(body), f"stop-{lid}-{lease.epoch}", trace)]
    if event_name == "SessionOpened" and lease.last_session is not None \
            and lease.state is LeaseState.RUNNING:
        s = lease.last_session
        order = SessionOrder(lease_id=lid, epoch=int(s["epoch"]), tenant=lease.tenant_id,
                             session_id=s["session_id"], kind=s["kind"],
                             command=list(s["command"]), tty=bool(s["tty"]), rows=s["rows"],
                             cols=s["cols"], port=s["port"])
        return [AgentOrder(node, "session", encode(order), f"session-{s['session_id']}", trace)]
    if event_name == "PreemptionNoticed":
        at = lease.preemption_noticed_at if hasattr(lease, "preemption_noticed_at") else None
        left = grace
        if lease.grace_deadline is not None and at is not None:
            left = max(0, round(lease.grace_deadline - at))
        body = v1.LeaseRevocation(lease_id=lid, epoch=lease.epoch, grace_seconds=min(left, 3600),
                                  reason="preempted")
        return [AgentOrder(node, "preempt", encode(body), f"preempt-{lid}-{lease.epoch}", trace)]
    if event_name == "ReconciliationStarted":
        body = v1.LeaseRevocation(lease_id=lid, epoch=lease.epoch, grace_seconds=grace,
                                  reason=f"expired:{lease.expiry_reason or 'expired'}")
        return [AgentOrder(node, "stop", encode(body), f"reconcile-{lid}-{lease.epoch}", trace)]
    return []


class Dispatcher:
    """Follows the log through `app`'s recorder; sends agent orders and arms timers."""

    def __init__(self, app: Any, link: ControlLink, *,
                 feed: FeedPublisher | None = None) -> None:
        self.app = app
        # the log as this fold reads it (bus.recorders: bus.jetstream's, or the plain path)
        self.recorder = log_recorder(app.recorder)
        self.link = link
        # the tenants' lease feed, told of every lease event this fold applies
        self.feed = feed
        self.position = 0
        self.sent_upto = 0  # orders for events at or below this were sent in an earlier life
        # a lease still queued has no orders and no timer: held compactly (workers.pending)
        self.aggregates = LeaseMemory()
        self._fold = Fold(self.aggregates)
        # the mapper's to_domain_event without its walk over the whole decoded state, as the
        # scheduler's fold decodes (anything unusual goes through the mapper itself)
        self._decode = EventDecoder(app.mapper)
        self.pools: dict[str, Pool] = {}
        self._armed: dict[str, float] = {}
        self._outbox: list[AgentOrder] = []
        self._timers: list[Aggregate] = []
        # queued leases (compact) whose queue timeout is to be armed: not kept in `_armed`
        # once armed, so a queue of millions costs no memory here past its own records
        self._queue_timers: list[QueuedLease] = []
        # held leases waiting for others (domain.dependency): a lease's id → the leases that
        # wait for it, each timer armed when it ends (and once when the waiter is requested,
        # for a lease that had ended already), so the reconciler queues or ends the waiter
        self._waiting: dict[str, list[str]] = {}
        self._dependency_timers: dict[str, float] = {}
        self._consumers: set[str] = set()
        self._started = False
        self.orders_sent = 0
        self.timers_armed = 0
        self._saved_at = time.monotonic()  # when the position was last saved
        self._timers_at = time.monotonic()  # when timers were last armed
        # the next page's read, asked for by a step that ended before it came: (start, read)
        self._ahead: tuple[int, concurrent.futures.Future[Any]] | None = None
        # where this fold is checkpointed and, at start, restored from
        # (workers.scheduler.checkpoint); None: every start-up replays the whole log
        self.checkpoints: Checkpointer | None = None
        # makes a tenant's telemetry stream before its first job starts (a plane whose user
        # may make streams: bus.telemetry_streams.MadeOnFirstUse); None: the operator did
        self.tenant_streams: Callable[[str], None] | None = None

    def start(self) -> None:
        self.sent_upto = self.link.load_position(POSITION_KEY)
        if self.feed is not None:
            self.feed.start()
        if self.checkpoints is not None and not self.position:
            self.checkpoints.restore(self)  # then only the events after it are folded
        self._started = True

    # a checkpoint is taken on the dispatcher's own thread, between steps (after_cycle): no
    # other thread changes its fold, so none is locked out meanwhile
    checkpoint_lock = contextlib.nullcontext()

    def checkpoint_state(self) -> dict[str, Any] | None:
        """The fold a checkpoint holds; None while orders, timers or feed records decided
        from it have not gone out yet (they are not part of it)."""
        if (self._outbox or self._timers or self._queue_timers or self._consumers
                or self._dependency_timers):
            return None
        feed = None
        if self.feed is not None:
            feed = self.feed.checkpoint_state(self.position)
            if feed is None:
                return None
        return {"position": self.position, "aggregates": self.aggregates, "_fold": self._fold,
                "pools": self.pools, "_armed": self._armed, "feed": feed,
                "_waiting": self._waiting}

    def restore_checkpoint(self, state: dict[str, Any]) -> bool:
        """Take a verified checkpoint's fold; False (nothing taken) when the feed holds fewer
        records than the checkpoint assumes written, so a full replay writes them."""
        feed = state.get("feed")
        if self.feed is not None and not self.feed.restore_checkpoint(feed, state["position"]):
            return False
        for name in ("position", "aggregates", "_fold", "pools", "_armed"):
            setattr(self, name, state[name])
        self._waiting = state.get("_waiting") or {}
        return True

    def step(self) -> int:
        """Read what is new; returns the number of notifications read. Orders decided from a
        page are kept in an outbox until sent, so a bus failure delays them, never drops them."""
        if not self._started:
            self.start()
        self._flush()
        n = 0
        decode = self._decode
        for page in self._pages():
            touched: dict[UUID, Aggregate] = {}
            for note in page:
                self.position = note.id
                if not note.topic.startswith(_TOPICS):
                    continue
                event = decode(note)
                agg = self._apply(event, note.id)
                if agg is None:
                    continue
                name = type(event).__name__
                if name not in LATER_ONLY:
                    touched[agg.id] = agg
                if isinstance(agg, Node) and name in ("NodeRegistered", "NodeReregistered"):
                    self._consumers.add(agg.node_id)  # its agent's queue exists from the start
                if isinstance(agg, Lease) and note.id > self.sent_upto:
                    self._outbox += orders_for(type(event).__name__, agg,
                                               self.pools.get(agg.pool_id))
            self._timers += [a for a in touched.values() if a.id in self.aggregates]
            n += len(page)
            sent = self.orders_sent
            # a page's timers wait for the next pages' (their deadlines are seconds away, and
            # each batch costs the server a store of its own) until enough are due or the step
            # ends; the feed's records go with every page
            self._flush(timers=len(self._timers) + len(self._queue_timers)
                        + len(self._dependency_timers) >= TIMERS_BATCH
                        or time.monotonic() - self._timers_at >= TIMERS_EVERY_S)
            # orders sent: their position now, or a restart would send them again. Otherwise
            # at most every POSITION_EVERY_S: a restart folds those events again, and what it
            # decides from them (timers, feed records) is written only once
            if self.position > self.sent_upto and (
                    self.orders_sent > sent
                    or time.monotonic() - self._saved_at >= POSITION_EVERY_S):
                self._save_position()
        if self._timers or self._dependency_timers:
            self._flush()
        if self.position > self.sent_upto:
            self._save_position()
        if not n and self.feed is not None:
            self.feed.idle()
        if self.checkpoints is not None:
            self.checkpoints.after_cycle(self, idle=not n)
        return n

    def _save_position(self) -> None:
        self.sent_upto = self.position
        self.link.save_position(POSITION_KEY, self.position)
        self._saved_at = time.monotonic()

    def _pages(self) -> Iterator[Sequence[Any]]:
        """The notifications after `position`, a page at a time, to the end of the log. The
        first is asked for and awaited (or was asked for by the step before). Each next one
        is asked for before the page before it is yielded, through the recorder's read-ahead
        (bus.jetstream's `prefetch`, a pull consumer) when it `reads_ahead`: it is read while that
        page is folded and its orders, timers and feed records are stored, which a follower
        that keeps up with a steady log would otherwise wait for in turn. Such a page may hold
        fewer events than are stored, so they are read until one is empty. Under a steady log
        that never happens: past STEP_MAX_S, a short page (no backlog behind it) ends the step
        and the read asked for after it is left to the next step (`_ahead`), so a step still
        ends, and with it what a step's end does (timers, position, checkpoint)."""
        recorder = self.recorder
        prefetch = recorder.prefetch if recorder.reads_ahead else None
        timeout = recorder.timeout + 20.0
        carried, self._ahead = self._ahead, None
        if carried is not None and carried[0] == self.position + 1:
            page = carried[1].result(timeout)
        else:
            if carried is not None:
                carried[1].cancel()
            page = recorder.select_notifications(start=self.position + 1, limit=PAGE)
        ahead: tuple[int, concurrent.futures.Future[Any]] | None = None
        started = time.monotonic()
        try:
            while page:
                if prefetch is not None:
                    at = page[-1].id + 1
                    ahead = (at, prefetch(at, PAGE))
                yield page
                if ahead is None:
                    if len(page) < PAGE:
                        return
                    page = recorder.select_notifications(start=self.position + 1, limit=PAGE)
                    continue
                if len(page) < PAGE and time.monotonic() - started >= STEP_MAX_S:
                    self._ahead, ahead = ahead, None
                    return
                got, ahead = ahead[1], None
                page = got.result(timeout)
        finally:
            if ahead is not None:  # left by a fold or a send that raised: not read
                ahead[1].cancel()

    def _flush(self, *, timers: bool = True) -> None:
        """Send what was decided: agents' consumers, orders, the feed's records and, with
        `timers`, the timers to arm (else they wait for a later flush)."""
        while self._consumers:
            self.link.ensure_agent_consumer(next(iter(self._consumers)))
            self._consumers.pop()
        while self._outbox:
            order = self._outbox[0]
            hdrs = {HDR_TRACEPARENT: order.traceparent} if order.traceparent else None
            if order.tenant and self.tenant_streams is not None:
                self.tenant_streams(order.tenant)
            self.link.send(order.node_id, order.verb, order.body, msg_id=order.msg_id,
                           headers=hdrs)
            self._outbox.pop(0)
            self.orders_sent += 1
        # each aggregate's due time is read from its state now, so an aggregate touched on
        # several pages is armed once; the timers' publishes are in flight together, and with
        # the feed's records (another stream): what a tenant sees waits for neither
        due: dict[str, tuple[str, str, float]] = {}
        for agg in self._timers if timers else ():
            timer = self._timer(agg)
            if timer is not None:
                key, at = timer
                kind, ident = key.split(":", 1)
                due[key] = (kind, ident, at)
        # a queued lease's queue timeout, if it still waits as it did (else its later
        # events armed what it has now, above)
        queue_due: dict[str, tuple[str, str, float]] = {}
        for record in self._queue_timers if timers else ():
            key, when = f"lease:{record.id}", record.next_due_at()
            if (when is not None and key not in due
                    and self.aggregates.queued.get(record.id) is record):
                queue_due[key] = ("lease", str(record.id), when)
        for lid, when in self._dependency_timers.items() if timers else ():
            queue_due.setdefault(f"lease:{lid}", ("lease", lid, when))
        armed = (self.link.schedule_many_started(list(queue_due.values()) + list(due.values()))
                 if timers and (self._timers or self._queue_timers or self._dependency_timers)
                 else None)
        try:
            if self.feed is not None:
                self.feed.flush(self.position)
        finally:
            # a feed that failed still waits for the timers; what was not armed stays to arm
            if armed is not None:
                armed.wait()
        if armed is None:
            return
        for key, (_kind, _ident, at) in due.items():
            self._armed[key] = at
        self.timers_armed += len(due) + len(queue_due)
        self._timers.clear()
        self._queue_timers.clear()
        self._dependency_timers.clear()
        self._timers_at = time.monotonic()

    def _apply(self, event: Any, log_seq: int) -> Aggregate | None:
        after = (_after(getattr(event, "workflow", None)) if type(event) is _REQUESTED
                 else None)
        if after:
            self._note_waiter(event, after)
        absorbed = self.aggregates.absorb(event)
        if absorbed is not False:
            if self.feed is not None:
                self.feed.observe(event, absorbed, log_seq)
            # requested or queued: nothing to send; a queue timeout's timer to arm
            if isinstance(absorbed, QueuedLease) and absorbed.next_due_at() is not None:
                self._queue_timers.append(absorbed)
            return None
        agg: Aggregate | None = self._fold.step(event)
        if agg is None:
            return None
        if self.feed is not None and isinstance(agg, Lease):
            self.feed.observe(event, agg, log_seq)
        if isinstance(agg, Lease) and agg.is_terminal:
            self._wake_waiters(agg)
        if isinstance(agg, Lease) and agg.is_terminal and agg.state is not LeaseState.PREEMPTED:
            # nothing more will be sent for it. A preempted lease is kept: it may be requeued
            # (in the same save or later) and placed again, and that placement needs its orders
            self.aggregates.pop(agg.id, None)
            self._armed.pop(f"lease:{agg.id}", None)
            return None
        if isinstance(agg, Pool):
            self.pools[agg.pool_id] = agg
        return agg

    def _note_waiter(self, event: Any, after: Any) -> None:
        """A lease requested to wait for others: remembered under each, and checked once now
        (one it names may have ended before this request was folded)."""
        waiter = str(event.originator_id)
        for dep in after:
            if isinstance(dep, (list, tuple)) and dep:
                self._waiting.setdefault(str(dep[0]), []).append(waiter)
        # a check due at once: the time is the server's to fire it, not a deadline of the
        # lease's, so it is this machine's now (whatever clock the domain was given)
        self._dependency_timers[waiter] = time.time()

    def _wake_waiters(self, lease: Lease) -> None:
        """`lease` ended: the leases that wait for it are checked (their timers fire now)."""
        for waiter in self._waiting.pop(str(lease.id), ()):
            self._dependency_timers[waiter] = time.time()

    def _timer(self, agg: Aggregate) -> tuple[str, float] | None:
        """(timer key, due time) when `agg`'s timer must be (re)armed; None when it has none
        due or is armed for that time already."""
        due: float | None = None
        key = ""
        if isinstance(agg, Lease):
            due, key = agg.next_due_at(), f"lease:{agg.id}"
        elif isinstance(agg, Node):
            pool = self.pools.get(agg.pool_id)
            if pool is None:
                return None
            cfg = pool.config
            key = f"node:{agg.node_id}"
            if agg.state is NodeState.LOST:
                lost_at = getattr(agg, "lost_at", None)
                due = None if lost_at is None else lost_at + cfg.lost_node_release_seconds
            else:
                due = agg.last_heartbeat_at + cfg.node_timeout_seconds
        elif isinstance(agg, CapacityReservation):
            pool = self.pools.get(agg.pool_id)
            if pool is None:
                return None
            key = f"reservation:{agg.id}"
            due = agg.drain_due_at(pool.config.preemption.grace_seconds)
            if due is not None and agg.end_at <= due:
                due = None  # deleted or over before its drain would begin
        if due is None:
            # nothing is due: what was armed before fires and finds nothing to do; forgetting
            # it keeps this map to the aggregates that have a timer
            if key:
                self._armed.pop(key, None)
            return None
        if self._armed.get(key) == due:
            return None
        return key, due


class Reconciler:
    """Applies fired timers: each is acknowledged only after its decision was saved."""

    def __init__(self, app: Any, link: ControlLink) -> None:
        self.app = app
        self.link = link
        self.applied: list[str] = []
        self.rearmed = 0

    def step(self, timeout: float = 0.5) -> int:
        dues = self.link.fetch_due(timeout=timeout)
        for due in dues:
            try:
                if due.kind == "lease":
                    done = self.app.reconcile_due(due.id)
                    if done:
                        self.applied.append(f"{due.id}:{done}")
                    else:
                        self._rearm("lease", due.id, self.app.lease_next_due(due.id))
                elif due.kind == "node":
                    done_node = self.app.node_due(due.id)
                    self.applied += done_node
                    self._rearm("node", due.id, self.app.node_next_due(due.id))
                elif due.kind == "reservation":
                    drained = self.app.reservation_due(due.id)
                    if drained:
                        self.applied.append(f"{due.id}:{drained}")
                    else:
                        self._rearm("reservation", due.id,
                                    self.app.reservation_next_due(due.id))
            except Exception:  # leave it unacked: redelivered after ack_wait
                log.exception("timer %s.%s failed", due.kind, due.id)
                continue
            due.ack()
        return len(dues)

    def _rearm(self, kind: str, ident: str, at: float | None) -> None:
        """A timer that fired early (its deadline moved later) is set again for the new one."""
        if at is not None:
            self.link.schedule(kind, ident, at)
            self.rearmed += 1


def run_loop(step: Callable[[], int], stop: threading.Event, *, idle: float | None = None,
             name: str = "loop", until: Callable[[], bool] = lambda: False,
             signal: Signal | None = None) -> None:
    """Call `step` until `stop` (or `until()`); when it found nothing, wait for the next append
    on `signal` (at most `idle` seconds), or sleep `idle` without one; survive failures."""
    wait = IdleWait(stop, signal, fallback_seconds=idle)
    while not stop.is_set() and not until():
        try:
            n = step()
        except Exception:  # the bus may be down for a moment; the log is truth
            log.exception("%s step failed", name)
            stop.wait(1.0)
            continue
        if not n:
            wait()
