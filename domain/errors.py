"""Every refusal the domain can make, one class per failure, each with a stable `code`.
Replies carry them as `error.code`, `error.message`, `error.reasons`: docs/api.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar


class DomainError(Exception):
    """A command the domain refused; nothing was recorded."""

    code: ClassVar[str] = "domain_error"

    def __init__(self, message: str, *, reasons: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.reasons: tuple[str, ...] = tuple(reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "reasons": list(self.reasons)}


# Lifecycle ------------------------------------------------------------------------------------


class IllegalTransition(DomainError):
    """The verb is not allowed from the aggregate's current state."""

    code = "illegal_transition"

    def __init__(
        self, from_state: str, verb: str, *, reasons: Iterable[str] = (), detail: str = ""
    ) -> None:
        self.from_state = str(from_state)
        self.verb = verb
        message = f"cannot {verb} from state {self.from_state!r}"
        super().__init__(f"{message}: {detail}" if detail else message, reasons=reasons)


class NotDue(DomainError):
    """A timer-driven transition was asked for before its deadline."""

    code = "not_due"


class LeaseExpired(DomainError):
    """The lease (or its reservation) is past a deadline; it can only be wound down."""

    code = "lease_expired"

    def __init__(self, reason: str, *, message: str = "") -> None:
        self.reason = reason
        super().__init__(message or f"lease expired ({reason})", reasons=(reason,))


class StaleEpoch(DomainError):
    """A report from an earlier placement of the lease (its epoch is not the current one)."""

    code = "stale_epoch"

    def __init__(self, current: int, given: int) -> None:
        self.current = current
        self.given = given
        super().__init__(f"epoch {given} is stale; the lease is at epoch {current}")


class RuntimeLimitExceeded(DomainError):
    """A runtime past a limit: a request longer than the pool's maximum runtime, or a renewal
    of a lease that already ends at its own."""

    code = "maximum_runtime_exceeded"


class WorkdirTooLarge(DomainError):
    """A job's packed work directory is bigger than its pool's max_workdir_bytes."""

    code = "workdir_too_large"


class VolumeUnknown(DomainError):
    """A job asks for a volume its pool does not offer."""

    code = "volume_unknown"


class VolumeNotAllowed(DomainError):
    """A job asks for a volume its pool offers only to nodes of other trust levels."""

    code = "volume_not_allowed"


class QueueLimitExceeded(DomainError):
    """The request would take the tenant past its pool's max_queued_leases."""

    code = "queue_limit_exceeded"


class AttemptLimitExceeded(DomainError):
    """A retry policy asks for more attempts than its pool's max_attempts."""

    code = "max_attempts_exceeded"


class VoidedReservationLimit(DomainError):
    """The tenant let the pool's max_voided_reservations time out uncommitted within its
    window: its new requests wait until the oldest of them leaves the window."""

    code = "voided_reservation_limit"

    def __init__(self, message: str, *, limit: int, window_seconds: int,
                 retry_after_seconds: float) -> None:
        super().__init__(message, reasons=("max_voided_reservations",
                                           "voided_reservation_window_seconds"))
        self.retry_after_seconds = retry_after_seconds
        self.details: dict[str, int] = {
            "max_voided_reservations": limit, "voided_reservation_window_seconds": window_seconds,
            "retry_after_seconds": max(1, math.ceil(retry_after_seconds))}


class RateLimited(DomainError):
    """The tenant sent requests faster than its pool's requests_per_second (past the burst)."""

    code = "rate_limited"

    def __init__(self, message: str, *, rate_per_second: int, burst: int,
                 retry_after_seconds: float) -> None:
        super().__init__(message, reasons=("requests_per_second", "request_burst"))
        self.retry_after_seconds = retry_after_seconds
        # the reply's reasons carry the limit and when to come back (HTTP Retry-After)
        self.details: dict[str, int] = {
            "requests_per_second": rate_per_second, "request_burst": burst,
            "retry_after_seconds": max(1, math.ceil(retry_after_seconds))}


class SessionLimit(DomainError):
    """A lease took more exec and port-forward sessions than its window allows."""

    code = "session_limit"

    def __init__(self, message: str, *, limit: int, window_seconds: int,
                 retry_after_seconds: float) -> None:
        super().__init__(message, reasons=("sessions_per_window",))
        self.details: dict[str, int] = {
            "sessions_per_window": limit, "session_window_seconds": window_seconds,
            "retry_after_seconds": max(1, math.ceil(retry_after_seconds))}


# Capacity -------------------------------------------------------------------------------------


class CapacityError(DomainError):
    """The policy's node table was asked to hold an allocation past a node's capacity."""

    code = "capacity_exceeded"


class OverAllocation(DomainError):
    """The allocation does not fit in the node's free capacity."""

    code = "insufficient_capacity"

    def __init__(self, dimensions: Sequence[str], *, message: str = "") -> None:
        self.dimensions: tuple[str, ...] = tuple(dimensions)
        super().__init__(
            message or f"insufficient capacity in {', '.join(self.dimensions)}",
            reasons=self.dimensions,
        )


class NodeNotSchedulable(DomainError):
    """The node is not ready (cordoned, draining, in maintenance or lost)."""

    code = "node_not_schedulable"

    def __init__(self, state: str) -> None:
        self.state = str(state)
        super().__init__(f"node is {self.state}, not ready", reasons=(self.state,))


class NodeNotEmpty(DomainError):
    """The node still holds allocations, so it cannot enter maintenance."""

    code = "node_not_empty"


class AlreadyAllocated(DomainError):
    """The lease already holds an allocation on this node."""

    code = "already_allocated"


class DeviceUnavailable(DomainError):
    """A device asked for is not on the node, is held by another lease, or does not match."""

    code = "device_unavailable"


class UnknownAllocation(DomainError):
    """The node holds no allocation for that lease."""

    code = "unknown_allocation"


class QuotaExceeded(DomainError):
    """The request would take the tenant past its quota in the named dimensions."""

    code = "quota_exceeded"

    def __init__(self, dimensions: Sequence[str]) -> None:
        self.dimensions: tuple[str, ...] = tuple(dimensions)
        super().__init__(
            f"quota exceeded in {', '.join(self.dimensions)}", reasons=self.dimensions
        )


# Credits --------------------------------------------------------------------------------------


class InsufficientCredits(DomainError):
    """The account's available credits do not cover the hold."""

    code = "insufficient_credits"

    def __init__(self, available: int, requested: int) -> None:
        self.available = available
        self.requested = requested
        super().__init__(
            f"{requested} micro-credits requested, {available} available",
            reasons=("insufficient_credits",),
        )


class InvalidAmount(DomainError):
    """An amount is not a non-negative (or, where required, positive) integer."""

    code = "invalid_amount"


class NodeClaimRefused(DomainError):
    """A node agent claimed a pool or capacity outside its enrollment, or was never enrolled;
    `reasons` names each dimension."""

    code = "node_claim_refused"


class TransferConflict(DomainError):
    """The transfer id names an earlier movement with another amount (or another kind): a retry
    must repeat its movement exactly, anything else is a mistake, not a retry."""

    code = "transfer_conflict"


class UnknownHold(DomainError):
    """The account holds nothing for that lease (never held, or already settled/released)."""

    code = "unknown_hold"


# Configuration --------------------------------------------------------------------------------


class InvalidConfiguration(DomainError):
    """Pool or tenant settings are inconsistent; `reasons` names each problem."""

    code = "invalid_configuration"


class InvalidReservation(DomainError):
    """A reservation's window, tenant, shape or nodes do not make a reservation."""

    code = "invalid_reservation"


class ReservationDeleted(DomainError):
    """The reservation was deleted already."""

    code = "reservation_deleted"


class UnknownPriorityClass(DomainError):
    """The pool defines no priority class of that name."""

    code = "unknown_priority_class"


class PriorityClassNotAllowed(DomainError):
    """The pool has the priority class, but the operator has not granted it to the tenant."""

    code = "priority_class_not_allowed"


class PriceNotListed(DomainError):
    """The price list has no price for a dimension the shape uses (and no "*" fallback)."""

    code = "price_not_listed"


# Images ---------------------------------------------------------------------------------------


class ImageNotAllowed(DomainError):
    """The pool's image policy refuses the job; `reasons` lists each image_* / runtime code."""

    code = "image_not_allowed"

    def __init__(self, reasons: Sequence[str], *, image: str = "") -> None:
        self.codes: tuple[str, ...] = tuple(reasons)
        what = f"image {image!r}" if image else "the job"
        super().__init__(f"{what} is refused by the pool's image policy: "
                         f"{', '.join(self.codes)}", reasons=self.codes)


# Webhooks -------------------------------------------------------------------------------------


class InvalidWebhook(DomainError):
    """A webhook endpoint's URL or event names are not ones the pool can deliver to."""

    code = "invalid_webhook"


class UnknownWebhook(DomainError):
    """The tenant has no webhook endpoint of that id."""

    code = "unknown_webhook"


class WebhookLimit(DomainError):
    """The tenant has as many webhook endpoints as the plane allows it."""

    code = "webhook_limit"
