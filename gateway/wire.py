"""The HTTP API's own shapes: the lease request with its key optional, and the replies.
Derived from the NATS API's Structs (schemas/v1.py), so a new field reaches both APIs at once.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from schemas import v1


class LeaseCreate(v1.LeaseRequest, frozen=True, kw_only=True):
    """`POST /v1/compute-leases`: a LeaseRequest whose idempotency key may come from the
    `Idempotency-Key` header instead (the concept's example body has none)."""

    # widening a field in a subclass is what makes this a derived Struct, not a copy
    idempotency_key: v1.IdempotencyKey | None = None  # type: ignore[assignment]


Seconds = float | None


class LeaseGangMember(Struct, frozen=True, kw_only=True):
    """One member of a gang as a reply shows it beside any of its members."""

    member: int | None = None
    lease_id: str
    state: str
    epoch: int
    node_id: str | None = None
    devices: list[str] = []


class LeaseGang(Struct, frozen=True, kw_only=True):
    """A gang's constraint and its members in member order (schemas.convert.gang_view)."""

    gang_id: str
    size: int
    strategy: str
    same: str | None = None
    spread: str | None = None
    members: list[LeaseGangMember]


class Lease(Struct, frozen=True, kw_only=True):
    """A lease as the command service shows it (schemas.convert.lease_view)."""

    lease_id: str
    tenant: str
    pool_id: str
    state: str
    epoch: int
    node_id: str | None = None
    devices: list[str] = []  # the node's GPU devices the lease holds
    name: str | None = None
    labels: dict[str, str] = {}
    priority_class: str
    preemptible: bool = True
    checkpointable: bool = False
    requeue_on_preemption: bool = False
    shape: dict[str, Any]
    maximum_runtime_seconds: int
    requested_at: Seconds = None
    reserved_at: Seconds = None
    reservation_deadline: Seconds = None
    started_at: Seconds = None
    deadline: Seconds = None
    last_heartbeat_at: Seconds = None
    last_checkpoint_at: Seconds = None
    hold_microcredits: int | None = None
    attempts: int = 0
    exit_code: int | None = None
    end_reason: str | None = None
    rejection_code: str | None = None
    version: int
    # each retried attempt's end: {attempt, end_reason, node_id, exit_code, ended_at}
    attempt_ends: list[dict[str, Any]] = []
    # why a held lease waits out of the queue (waiting_for_dependency, retry_backoff), and
    # until when a backoff lasts
    held_reason: str | None = None
    held_until: Seconds = None
    after: list[list[str]] = []  # [lease id, ok|any|notok] it waits for
    max_running: int | None = None  # its array's throttle
    gang: LeaseGang | None = None  # a gang member's: every member, its node and devices


class Page(Struct, frozen=True, kw_only=True):
    """One page of a view's rows; pass `next_cursor` back as `cursor` for the next."""

    items: list[dict[str, Any]]
    next_cursor: str | None = None


class Whoami(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`GET /v1/whoami`: who the bearer token speaks for (the tenant, or the admin)."""

    kind: Literal["tenant", "admin"]
    tenant: str | None = None
