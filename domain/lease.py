"""The lease lifecycle: a tenant's claim on pooled capacity, from request to release.

States and verbs: docs/architecture.md#the-lease-lifecycle. This module holds the aggregate: its
request, its recorded state and its events; its verbs are mixins, one module each (lease_*).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event
from eventsourcing.utils import get_topic

from domain.creation import initialised, lean_init
from domain.dependency import WAITING_FOR_DEPENDENCY, Dependency
from domain.errors import InvalidAmount
from domain.fold import lean_paths
from domain.gang import GangMembership
from domain.ids import pair_uuid
from domain.jobspec import JobSpec
from domain.lease_guards import require_positive_int
from domain.lease_jobs import LeaseJobs, job_outcome
from domain.lease_sessions import SESSION_WINDOW_SECONDS, SESSIONS_PER_WINDOW, LeaseSessions
from domain.lease_term import LeaseTerm
from domain.lease_transitions import LeaseTransitions
from domain.lease_values import (
    CAPACITY_HOLDING_STATES,
    END_REASONS,
    EXPIRY_REASONS,
    TERMINAL_STATES,
    WORKLOAD_STATES,
    AttemptEnd,
    Job,
    JobState,
    LeaseState,
    queue_deadline,
)
from domain.lease_workflow import LeaseWorkflow
from domain.resources import LeaseId, NodeId, PoolId, Resources, Shape, TenantId
from domain.retry import RETRY_BACKOFF, RetryPolicy

# the lease's values and words, importable from here as before they had modules of their own
__all__ = [
    "CAPACITY_HOLDING_STATES",
    "END_REASONS",
    "EXPIRY_REASONS",
    "SESSIONS_PER_WINDOW",
    "SESSION_WINDOW_SECONDS",
    "TERMINAL_STATES",
    "WORKLOAD_STATES",
    "AttemptEnd",
    "Job",
    "JobSpec",
    "JobState",
    "Lease",
    "LeaseState",
    "queue_deadline",
]

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:lease")
S = LeaseState


class Lease(LeaseTransitions, LeaseTerm, LeaseJobs, LeaseWorkflow, LeaseSessions, Aggregate):
    """A tenant's claim on capacity; see the module docstring for the state machine."""

    # what its tenant calls it; the class's values stand for a lease restored from a snapshot
    # taken before names and labels (never changed in place)
    name: str | None = None
    labels: tuple[tuple[str, str], ...] = ()  # sorted (key, value)
    # the latest interactive session opened into the running job (exec, port-forward): what
    # the dispatcher tells the lease's node; who, when and what, never the bytes
    last_session: dict[str, Any] | None = None
    # sessions opened in the current window (each is an event in the log: a fair-use limit)
    session_window_at: float | None = None
    sessions_in_window: int = 0
    # retries, dependencies and array throttles, as the request's event has them (one field,
    # so a request without them costs the log one null): {"retries": RetryPolicy.to_dict(),
    # "after": [[lease id, condition], …], "array_id": …, "max_running": …}; absent before them
    workflow: dict[str, Any] | None = None
    held_reason: str | None = None
    held_until: float | None = None
    attempt_ends: tuple[AttemptEnd, ...] = ()
    avoid_node: str | None = None
    retrying = False
    # its place among the `count` leases of one request (POOL_ARRAY_INDEX of POOL_ARRAY_SIZE);
    # None and 0: a lone lease, a gang member, or one restored from before arrays
    array_index: int | None = None
    array_size: int = 0

    @staticmethod
    def create_id(tenant_id: str, idempotency_key: str) -> UUID:
        """The lease id for a tenant's idempotency key: a retried request finds the same lease."""
        return pair_uuid(_NAMESPACE, str(tenant_id), str(idempotency_key))

    @classmethod
    def request(
        cls,
        *,
        tenant_id: TenantId,
        pool_id: PoolId,
        idempotency_key: str,
        shape: Shape,
        maximum_runtime_seconds: int,
        now: float,
        lease_seconds: int | None = None,
        heartbeat_timeout_seconds: int = 30,
        priority_class: str = "default",
        preemptible: bool = True,
        trace_parent: str | None = None,
        request_digest: str | None = None,
        checkpointable: bool = False,
        requeue_when_preempted: bool = False,
        advance_reservation_id: str | None = None,
        gang: GangMembership | None = None,
        queued: bool = False,
        queue_timeout_seconds: int | None = None,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        retries: RetryPolicy | None = None,
        after: tuple[Dependency, ...] = (),
        array_id: str | None = None,
        max_running: int | None = None,
        array: tuple[int, int] | None = None,
    ) -> Lease:
        """Record a request. `lease_seconds` is the initial term and default renewal (defaults
        to the maximum runtime); the id is `create_id(tenant_id, idempotency_key)`.
        `preemptible` False: never a victim; `requeue_when_preempted`: a preemption puts it
        back in the queue and its interrupted job restarts on the next placement, instead
        of ending it as `preempted`; `checkpointable`: its work resumes from checkpoints;
        `gang`: the gang it is a member of (domain.gang), placed all-or-nothing with it;
        `queued`: admitted to the queue by the same event (one event a request), as
        `queue(now)` right after would; `queue_timeout_seconds`: how long it may wait in the
        queue (each time it is queued) before it ends `queue_timeout` (None: for ever);
        `name` and `labels`: what the tenant calls it, to find it by in lists; `retries`:
        when an attempt that ends badly runs again (domain.retry); `after`: the leases it
        waits for, `held` (not queued) until they ended as it asks (domain.dependency);
        `array_id` and `max_running`: at most that many of the array's leases hold capacity
        at once; `array`: its (index, size) among the leases of one `count` request."""
        term = maximum_runtime_seconds if lease_seconds is None else lease_seconds
        for field_name, value in (
            ("maximum_runtime_seconds", maximum_runtime_seconds),
            ("lease_seconds", term),
            ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
        ):
            require_positive_int(field_name, value)
        if queue_timeout_seconds is not None:
            require_positive_int("queue_timeout_seconds", queue_timeout_seconds)
        if not shape.resources.is_non_negative():
            raise InvalidAmount("a shape cannot ask for negative resources")
        if max_running is not None:
            require_positive_int("max_running", max_running)
        fields: dict[str, Any] = {
            "tenant_id": str(tenant_id),
            "idempotency_key": idempotency_key,
            "pool_id": str(pool_id),
            "shape": shape.to_dict(),
            "maximum_runtime_seconds": maximum_runtime_seconds,
            "lease_seconds": term,
            "heartbeat_timeout_seconds": heartbeat_timeout_seconds,
            "priority_class": priority_class,
            "preemptible": bool(preemptible),
            "requested_at": float(now),
            "trace_parent": trace_parent,
            "request_digest": request_digest,
            "checkpointable": bool(checkpointable),
            "requeue_when_preempted": bool(requeue_when_preempted),
            "advance_reservation_id": advance_reservation_id,
            "gang": None if gang is None else gang.to_dict(),
            "queued_at": float(now) if queued else None,
            "queue_timeout_seconds": queue_timeout_seconds,
            "name": name,
            "labels": dict(labels) if labels else None,
            "array": None if array is None else [int(array[0]), int(array[1])],
        }
        workflow: dict[str, Any] = {}
        if retries is not None:
            workflow["retries"] = retries.to_dict()
        if after:
            workflow["after"] = [d.to_list() for d in after]
            fields["queued_at"] = None  # held, queued once they are met (`queue_held`)
        if array_id is not None and max_running is not None:
            workflow["array_id"], workflow["max_running"] = array_id, max_running
        fields["workflow"] = workflow or None
        if _LEAN_CREATE is None or cls is not Lease or not lean_paths():
            return cls(**fields)  # the library's creation (POOL_FAST_PATHS=off among others)
        return _created(fields)

    @event("LeaseRequested")
    def __init__(
        self,
        tenant_id: str,
        idempotency_key: str,
        pool_id: str,
        # a dict as events carry it; a Shape from a fold's compact record (workers.pending)
        shape: dict[str, Any] | Shape,
        maximum_runtime_seconds: int,
        lease_seconds: int,
        heartbeat_timeout_seconds: int,
        priority_class: str,
        preemptible: bool,
        requested_at: float,
        trace_parent: str | None = None,  # W3C traceparent of the request; absent in old events
        # the whole request's fingerprint, so a reused idempotency key with another body is told
        # from a retry; absent in old events
        request_digest: str | None = None,
        checkpointable: bool = False,
        # absent in events from before the wish was recorded, when every victim was requeued
        requeue_when_preempted: bool = True,
        # the advance reservation (domain.reservation) whose capacity it may use; absent in
        # events from before reservations
        advance_reservation_id: str | None = None,
        # the gang it is a member of (domain.gang.GangMembership); absent before gangs
        gang: dict[str, Any] | None = None,
        # set when the request is queued by this same event; absent in requests a
        # LeaseQueued event followed (every request before one event a request)
        queued_at: float | None = None,
        # how long it may wait in the queue before it ends `queue_timeout`; absent before
        # queue timeouts (such a lease waits for ever)
        queue_timeout_seconds: int | None = None,
        # what the tenant calls it (a name, labels); absent before names and labels
        name: str | None = None,
        labels: dict[str, str] | None = None,
        # its retry policy, the leases it waits for (held until then) and its array's throttle
        # (see the class attribute); absent before them
        workflow: dict[str, Any] | None = None,
        # [index, size] among the leases of one `count` request; absent before arrays
        array: list[int] | None = None,
    ) -> None:
        self.tenant_id = TenantId(tenant_id)
        self.idempotency_key = idempotency_key
        self.pool_id = PoolId(pool_id)
        self.requested_shape = shape if isinstance(shape, Shape) else Shape.from_dict(shape)
        self.shape = self.requested_shape  # the placed shape once reserved
        self.maximum_runtime_seconds = maximum_runtime_seconds
        self.lease_seconds = lease_seconds
        self.heartbeat_timeout_seconds = heartbeat_timeout_seconds
        self.priority_class = priority_class
        self.preemptible = preemptible
        self.checkpointable = checkpointable
        self.requeue_when_preempted = requeue_when_preempted
        self.advance_reservation_id = advance_reservation_id
        self.gang = None if gang is None else GangMembership.from_dict(gang)
        self.requested_at = requested_at
        self.trace_parent = trace_parent
        self.request_digest = request_digest
        self.state = LeaseState.REQUESTED if queued_at is None else LeaseState.QUEUED
        self.workflow = workflow
        if workflow and workflow.get("after"):
            self.state = LeaseState.HELD
            self.held_reason = WAITING_FOR_DEPENDENCY
        self.queued_at: float | None = queued_at
        self.queue_timeout_seconds = queue_timeout_seconds
        self.name = name
        self.labels = tuple(sorted((labels or {}).items()))
        if array is not None:
            self.array_index, self.array_size = int(array[0]), int(array[1])
        self.attempts = 1
        self.epoch = 0
        # Per placement; reset on each reservation.
        self.node_id: NodeId | None = None
        self.devices: tuple[str, ...] = ()  # the GPU devices of the node it holds
        self.reserved_at: float | None = None
        self.reservation_deadline: float | None = None
        self.hold_microcredits = 0
        self.started_at: float | None = None
        self.deadline: float | None = None
        self.run_ended_at: float | None = None
        self.last_heartbeat_at: float | None = None
        self.grace_deadline: float | None = None
        self.requeue_on_preemption = False
        self.stop_reason: str | None = None
        # Survive requeues: a checkpoint taken in one placement is resumed in the next.
        self.last_checkpoint_at: float | None = None
        self.job: Job | None = None
        self.jobs_submitted = 0
        # the job a preemption notice found active, until a commit restarts or replaces it
        self.interrupted_job: int | None = None
        # How it ended.
        self.expiry_reason: str | None = None
        self.end_reason: str | None = None
        self.exit_code: int | None = None
        self.ended_at: float | None = None
        self.rejection_code: str | None = None

    # Queries ----------------------------------------------------------------------------------

    @property
    def lease_id(self) -> LeaseId:
        return LeaseId(str(self.id))

    @property
    def resources(self) -> Resources:
        """What the lease occupies on its node (the placed shape's resources)."""
        return self.shape.resources

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def is_live(self) -> bool:
        return self.state not in TERMINAL_STATES

    @property
    def holds_capacity(self) -> bool:
        return self.state in CAPACITY_HOLDING_STATES

    def _end(self, at: float, state: LeaseState, reason: str) -> None:
        self.state = state
        self.end_reason = reason
        self.ended_at = at

    # Events: bodies run on record and on replay, so they only assign ---------------------------

    @event("LeaseQueued")
    def _queued(self, at: float) -> None:
        if self.state is S.HELD:
            self.held_reason = None
            self.held_until = None
        self.state = S.QUEUED
        self.queued_at = at

    @event("LeaseRejected")
    def _rejected(self, at: float, code: str, reasons: list[str]) -> None:
        self.rejection_code = code
        self._end(at, S.REJECTED, code)

    @event("LeaseReserved")
    def _reserved(
        self,
        at: float,
        node_id: str,
        shape: dict[str, Any] | None,
        epoch: int,
        reservation_deadline: float,
        hold_microcredits: int,
        devices: list[str] | None = None,  # absent before device inventories; None: count-only
    ) -> None:
        self.state = S.RESERVED
        self.node_id = NodeId(node_id)
        self.devices = tuple(devices) if devices else ()
        # None: placed as requested (older events always carry the shape)
        self.shape = self.requested_shape if shape is None else Shape.from_dict(shape)
        self.epoch = epoch
        self.reserved_at = at
        self.reservation_deadline = reservation_deadline
        self.hold_microcredits = hold_microcredits
        self.started_at = None
        self.deadline = None
        self.run_ended_at = None
        self.last_heartbeat_at = None
        self.grace_deadline = None
        self.requeue_on_preemption = False
        self.stop_reason = None

    @event("LeaseCommitted")
    def _committed(
        self,
        at: float,
        deadline: float,
        job_number: int | None,
        job_attempt: int | None,
        job_spec: dict[str, Any] | None,
    ) -> None:
        self.state = S.RUNNING
        self.started_at = at
        self.deadline = deadline
        self.interrupted_job = None
        self.retrying = False
        if job_spec is not None and job_number is not None:
            self.job = Job(number=job_number, spec=JobSpec.from_dict(job_spec), submitted_at=at,
                           attempts=job_attempt or 1)
            self.jobs_submitted = max(self.jobs_submitted, job_number)
            self.exit_code = None

    @event("JobSubmitted")
    def _job_submitted(self, at: float, job_number: int, spec: dict[str, Any]) -> None:
        self.job = Job(number=job_number, spec=JobSpec.from_dict(spec), submitted_at=at)
        self.jobs_submitted = job_number
        self.exit_code = None  # the lease shows its latest job's exit code

    @event("JobStarted")
    def _job_started(self, at: float, epoch: int) -> None:
        assert self.job is not None
        self.job = replace(self.job, state=JobState.RUNNING, started_at=at)

    @event("JobExited")
    def _job_exited(self, at: float, epoch: int, exit_code: int) -> None:
        self._end_job(at, exit_code=exit_code)
        self.exit_code = exit_code

    @event("JobFailed")
    def _job_failed(self, at: float, epoch: int, reason: str) -> None:
        self._end_job(at, failure=reason)

    @event("HeartbeatRecorded")
    def _heartbeat_recorded(self, at: float, epoch: int, checkpoint_at: float | None) -> None:
        self.last_heartbeat_at = at
        if checkpoint_at is not None:
            self.last_checkpoint_at = max(checkpoint_at, self.last_checkpoint_at or checkpoint_at)

    @event("SessionOpened")
    def _session_opened(self, at: float, session_id: str, kind: str, command: list[str],
                        tty: bool, port: int | None, rows: int | None, cols: int | None,
                        epoch: int) -> None:
        self.last_session = {"session_id": session_id, "kind": kind, "command": command,
                             "tty": tty, "port": port, "rows": rows, "cols": cols,
                             "epoch": epoch, "at": at}
        if self.session_window_at is None or at - self.session_window_at >= SESSION_WINDOW_SECONDS:
            self.session_window_at, self.sessions_in_window = at, 0
        self.sessions_in_window += 1

    @event("LeaseRenewed")
    def _renewed(self, at: float, deadline: float, clamped: bool) -> None:
        self.deadline = deadline

    @event("LeaseReleased")
    def _released(self, at: float, exit_code: int | None, reason: str) -> None:
        if reason == "completed":  # logs from before END_REASONS: the exit code tells
            reason = job_outcome(exit_code, self.job)
        if self.state in WORKLOAD_STATES:
            self.run_ended_at = at
        self._end_job(at, exit_code=exit_code, failure=reason)
        if exit_code is not None:
            self.exit_code = exit_code
        self._end(at, S.RELEASED, reason)

    @event("StopRequested")
    def _stop_requested(self, at: float, reason: str) -> None:
        self.state = S.STOPPING
        self.stop_reason = reason
        self.requeue_on_preemption = False

    @event("LeaseCancelled")
    def _cancelled(self, at: float, reason: str) -> None:
        if self.state in WORKLOAD_STATES:
            self.run_ended_at = at
        self._end_job(at, failure="cancelled")
        self.stop_reason = reason  # the holder's words; the end reason is the vocabulary's
        self._end(at, S.CANCELLED, "cancelled")

    @event("LeaseExpired")
    def _expired(self, at: float, reason: str) -> None:
        assert self.deadline is not None
        # Billing stops at the hard deadline even if the timer fired late.
        self.run_ended_at = min(at, self.deadline)
        self._end_job(at, failure="lease_expired")
        self.state = S.EXPIRED
        self.expiry_reason = reason

    @event("ReconciliationStarted")
    def _reconciliation_started(self, at: float) -> None:
        self.state = S.RECONCILING

    @event("ReservationVoided")
    def _voided(self, at: float, reason: str) -> None:
        self.expiry_reason = reason
        self._end(at, S.VOIDED, reason)

    @event("PreemptionNoticed")
    def _preemption_noticed(
        self, at: float, grace_deadline: float, requeue: bool, reason: str
    ) -> None:
        self.state = S.PREEMPTING
        self.interrupted_job = (self.job.number if self.job is not None and self.job.is_active
                                else None)
        self.grace_deadline = grace_deadline
        self.requeue_on_preemption = requeue
        self.stop_reason = reason

    @event("LeasePreempted")
    def _preempted(self, at: float) -> None:
        self.run_ended_at = at
        self._end_job(at, failure="preempted")
        self._end(at, S.PREEMPTED, "preempted")  # stop_reason keeps why (a drain, …)

    @event("LeaseRequeued")
    def _requeued(self, at: float, attempts: int) -> None:
        self.state = S.QUEUED
        self.attempts = attempts
        self.queued_at = at
        self.node_id = None  # the old placement is history; the next reserve picks anew
        self.devices = ()
        self.expiry_reason = None
        self.end_reason = None
        self.ended_at = None
        self.exit_code = None

    @event("LeaseRetried")
    def _retried(self, at: float, attempt: int, reason: str, exit_code: int | None,
                 node_id: str | None, held_until: float | None) -> None:
        if self.state in WORKLOAD_STATES:
            self.run_ended_at = at
        self._end_job(at, exit_code=exit_code, failure=reason)
        self.attempt_ends = (*self.attempt_ends, (self.attempts, reason, node_id, exit_code, at))
        self.attempts = attempt
        self.retrying = True
        self.avoid_node = node_id
        self.node_id = None  # the old placement is history; the next reserve picks anew
        self.devices = ()
        self.expiry_reason = None
        self.end_reason = None
        self.ended_at = None
        self.exit_code = None
        self.stop_reason = None
        self.requeue_on_preemption = False
        if held_until is not None:
            self.state = S.HELD
            self.held_reason = RETRY_BACKOFF
            self.held_until = held_until
        else:
            self.state = S.QUEUED
            self.queued_at = at


def _lean_create() -> tuple[str, ...] | None:
    """LeaseRequested's field names when a Lease may be created without the library
    (`domain.creation.lean_init`) and the event carries exactly the init's fields."""
    created: Any = Lease.LeaseRequested  # type: ignore[attr-defined]
    params = lean_init(Lease, created)
    names = tuple(created.__dataclass_fields__)
    base = {"originator_id", "originator_version", "timestamp", "originator_topic"}
    if params is None or set(names) != base | set(params):
        return None
    return names


_LEAN_CREATE = _lean_create()
_LEASE_TOPIC = get_topic(Lease)


def _created(fields: dict[str, Any]) -> Lease:
    """What `Lease(**fields)` makes through the library, made directly (the command path
    creates one a request; the library's generic creation is built for any aggregate)."""
    created: Any = Lease.LeaseRequested  # type: ignore[attr-defined]
    oid = Lease.create_id(fields["tenant_id"], fields["idempotency_key"])
    timestamp = created.create_timestamp()
    state = {"originator_id": oid, "originator_version": Lease.INITIAL_VERSION,
             "timestamp": timestamp, "originator_topic": _LEASE_TOPIC, **fields}
    assert _LEAN_CREATE is not None
    event_obj = object.__new__(created)
    object.__setattr__(event_obj, "__dict__", {name: state[name] for name in _LEAN_CREATE})
    lease = initialised(Lease, oid, Lease.INITIAL_VERSION, timestamp, fields)
    lease._pending_events.append(event_obj)
    return lease
