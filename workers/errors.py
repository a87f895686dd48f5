"""Errors of the control-plane services, above the domain: lookups, ownership, conflicts.

Each has a stable `code` and travels to clients as `error.code` in the reply envelope.
"""

from __future__ import annotations

from typing import ClassVar


class ServiceError(Exception):
    """Base class of every refusal made by a worker rather than by the domain."""

    code: ClassVar[str] = "service_error"

    def __init__(self, message: str, reasons: dict[str, int | str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reasons = reasons or {}


# -- lookups ---------------------------------------------------------------------------------


class UnknownPool(ServiceError):
    """No pool of that id has been created."""

    code = "unknown_pool"


class UnknownCohort(ServiceError):
    """No cohort of that name has been set in the pool."""

    code = "unknown_cohort"


class UnknownReservation(ServiceError):
    """No reservation of that id in the pool (or not the requesting tenant's)."""

    code = "unknown_reservation"


class ReservationExists(ServiceError):
    """A reservation of that id exists in the pool with other settings."""

    code = "reservation_exists"


class UnknownLease(ServiceError):
    """No lease of that id exists for this tenant (another tenant's lease reads the same)."""

    code = "lease_not_found"


class UnknownDependency(ServiceError):
    """`after` names no lease of this tenant (another tenant's lease reads the same), so
    only leases that already exist may be waited for, and no cycle can form."""

    code = "unknown_dependency"


class UnknownNode(ServiceError):
    """No node of that id has registered."""

    code = "unknown_node"


class UnknownSubject(ServiceError):
    """The subject names no command this service answers."""

    code = "unknown_command"


# -- requests --------------------------------------------------------------------------------


class IdempotencyConflict(ServiceError):
    """The idempotency key was used before for a different request."""

    code = "idempotency_conflict"


class Unschedulable(ServiceError):
    """No node in the pool could ever satisfy the shape; the counts say which filters failed."""

    code = "unschedulable"


class UnknownTenant(ServiceError):
    """No pool has this tenant: set it in one (tenant.set) before granting it credits."""

    code = "unknown_tenant"


class PoolExists(ServiceError):
    """A pool of that id exists already: change it with pool.set, not pool.create."""

    code = "pool_exists"


class WriteConflict(ServiceError):
    """Concurrent writers kept changing the same aggregates; the command was not applied."""

    code = "write_conflict"


class WebhooksUnavailable(ServiceError):
    """This plane cannot take webhooks: no key to seal their secrets (POOL_WEBHOOK_KEY)."""

    code = "webhooks_unavailable"


class WebhookAddressRefused(ServiceError):
    """The endpoint's host resolves to an address the plane does not POST to (SSRF guard)."""

    code = "webhook_address_refused"


class SecretsUnavailable(ServiceError):
    """This plane cannot keep secrets: no key ring to seal them (POOL_SECRET_KEYS)."""

    code = "secrets_unavailable"


class SecretUnknown(ServiceError):
    """The tenant has no secret of a name the command or job refers to (or not that version)."""

    code = "secret_unknown"


class SecretLimit(ServiceError):
    """The tenant keeps as many secrets as the plane allows; delete one first."""

    code = "secret_limit"
