"""RFC 9457 problem details: every refusal the gateway sends, with its stable error code.

The status of a code lives here and nowhere else; an unknown code is a 400, never a 500.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Response

PROBLEM_JSON = "application/problem+json"
# `type` URIs resolve under the gateway's own documentation page
TYPE_BASE = "/docs#problem-"

STATUS_BY_CODE: dict[str, int] = {
    # the request itself
    "malformed_json": 400, "invalid_utf8": 400, "unknown_kind": 400, "bad_request": 400,
    "invalid_field": 422, "unknown_field": 422, "missing_field": 422,
    "unsupported_schema_version": 422, "invalid_configuration": 422, "invalid_amount": 422,
    "unknown_priority_class": 422, "invalid_reservation": 422, "maximum_runtime_exceeded": 422, "price_not_listed": 422,
    "image_not_allowed": 422, "unschedulable": 422, "quota_exceeded": 422,
    "invalid_webhook": 422, "webhook_address_refused": 422,
    # a job's volume the pool does not offer, or offers only to nodes of other trust levels
    "volume_unknown": 422, "volume_not_allowed": 422,
    # a job's files: the archive's bytes are not what its digest names; over the pool's limit
    "digest_mismatch": 422, "workdir_too_large": 413,
    "payload_too_large": 413,
    # who is asking
    "unauthenticated": 401, "permission_denied": 403, "forbidden": 403,
    "tenant_not_enrolled": 403,
    "priority_class_not_allowed": 403,  # the operator grants classes per tenant
    # what it names
    "lease_not_found": 404, "unknown_pool": 404, "unknown_node": 404, "unknown_command": 404,
    "not_found": 404, "unknown_hold": 404, "unknown_allocation": 404, "unknown_cohort": 404,
    "object_missing": 404,  # a work directory or artifact never stored, deleted or expired
    "bucket_missing": 409,  # the tenant's file bucket is not made yet: the operator's step
    "bucket_quota_exceeded": 409,  # room comes back when objects are deleted or expire
    "bucket_quota_unreservable": 503,  # the operator's to fix: the server's store is too small
    "telemetry_retention_unreservable": 503,  # the same, for a tenant's telemetry stream
    "unknown_tenant": 404, "unknown_reservation": 404, "unknown_webhook": 404,
    "unknown_dependency": 404,
    "secret_unknown": 404,  # a secret the tenant never set, deleted, or a version not kept
    # the state it meets
    "idempotency_conflict": 409, "illegal_transition": 409, "stale_epoch": 409,
    "write_conflict": 409, "lease_expired": 409, "already_allocated": 409,
    "node_not_empty": 409, "insufficient_credits": 409, "insufficient_capacity": 409, "capacity_exceeded": 409, "invalid_subject": 400,
    "node_not_schedulable": 409, "not_due": 409,
    "pool_exists": 409, "reservation_exists": 409, "reservation_deleted": 409, "transfer_conflict": 409, "name_collision": 409,
    "device_unavailable": 409, "node_claim_refused": 403,
    "webhook_limit": 409,  # room comes back when the tenant deletes an endpoint
    "session_refused": 409,  # the lease's node would not open an exec or port-forward
    "session_limit": 429,  # each session is an event in the log: a window per lease
    # the lease's node: the job is not (or no longer) its, or cannot be entered; at most
    # MAX_SESSIONS_PER_LEASE at once
    "lease_not_here": 409, "lease_stopping": 409, "exec_unsupported": 409,
    "too_many_sessions": 429, "stdin_closed": 409,
    "secret_limit": 409,  # room comes back when the tenant deletes a secret
    # base classes: a refusal no subclass names more precisely
    "domain_error": 409, "service_error": 400,
    "method_not_allowed": 405,
    "too_many_requests": 429,
    "queue_limit_exceeded": 429,  # room comes back as the tenant's queued leases are placed
    "rate_limited": 429,  # a token comes back within Retry-After seconds
    "voided_reservation_limit": 429,  # lifts when the oldest void leaves the window
    "concurrency_limit": 429,  # a tenant's reads at once: room comes back as they finish
    "login_throttled": 429,  # an address's failed token checks: lifts as the oldest leaves
    "max_attempts_exceeded": 422,  # the pool's max_attempts: a smaller --retries fits
    # what is behind the gateway
    "bus_unavailable": 503, "bus_timeout": 503, "views_unavailable": 503,
    "telemetry_unavailable": 503, "publish_rejected": 503, "bus_error": 503,
    "batch_too_large": 503, "snapshots_unavailable": 503, "webhooks_unavailable": 503,
    "secrets_unavailable": 503,  # no key ring to seal or open secrets (POOL_SECRET_KEYS)
    "scheduler_unavailable": 503,  # no scheduler process answered an operator's question
    "feed_refused": 502,  # the control plane refused a feed replay the gateway asked for
    # a bug behind the gateway: logged there, reported here as the upstream's failure
    "internal_error": 502,
}

TITLES: dict[int, str] = {
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
    422: "Unprocessable Content", 429: "Too Many Requests", 502: "Bad Gateway",
    503: "Service Unavailable",
}


class Problem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An RFC 9457 problem: `code` and `reasons` are the command service's error, verbatim."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    reasons: dict[str, int | str] = {}
    instance: str | None = None


def status_of(code: str) -> int:
    return STATUS_BY_CODE.get(code, 400)


def problem(code: str, detail: str, reasons: dict[str, Any] | None = None, *,
            status: int | None = None, instance: str | None = None,
            headers: dict[str, str] | None = None) -> Response[bytes]:
    status = status or status_of(code)
    body = Problem(type=TYPE_BASE + code, title=TITLES.get(status, "Error"), status=status,
                   detail=detail[:1000], code=code,
                   reasons={str(k): v if isinstance(v, int | str) else str(v)
                            for k, v in (reasons or {}).items()},
                   instance=instance)
    return Response(msgspec.json.encode(body), status_code=status, media_type=PROBLEM_JSON,
                    headers=headers)


def from_error(error: dict[str, Any] | None, *, instance: str | None = None) -> Response[bytes]:
    """The problem for a not-ok reply envelope's `error`."""
    error = error or {}
    code = str(error.get("code") or "internal_error")
    reasons = error.get("reasons")
    reasons = reasons if isinstance(reasons, dict) else None
    # a refusal that says when to come back (rate_limited) says it the HTTP way too
    retry = (reasons or {}).get("retry_after_seconds")
    headers = {"Retry-After": str(retry)} if isinstance(retry, int) else None
    return problem(code, str(error.get("message") or code), reasons, instance=instance,
                   headers=headers)
