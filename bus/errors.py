"""Errors raised by the bus layer: everything NATS-shaped is translated into these at the boundary.

Each class has a stable `code`; callers above bus/ never see a nats-py exception.
"""

from __future__ import annotations


class BusError(Exception):
    """Base class of every error raised by bus/."""

    code = "bus_error"


# -- connectivity ----------------------------------------------------------------------------


class BusUnavailable(BusError):
    """The NATS server could not be started or reached."""

    code = "bus_unavailable"


class BusTimeout(BusError):
    """The NATS server did not answer in time; the outcome of a write is unknown."""

    code = "bus_timeout"


class FeedRefused(BusError):
    """The control plane refused a feed replay (its code is in `refusal_code`)."""

    code = "feed_refused"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"feed replay refused [{code}]: {message}")
        self.refusal_code = code


class PermissionDenied(BusError):
    """The server refused a publish or subscription: this user may not use that subject."""

    code = "permission_denied"


class NameCollision(BusError):
    """A tenant or node name that is not one subject token: it would share another's subjects,
    user and inbox."""

    code = "name_collision"


# -- writes ----------------------------------------------------------------------------------


class InvalidSubject(BusError, ValueError):
    """A name that cannot be one subject token (a tenant, a lease id, a verb)."""

    code = "invalid_subject"


class BatchTooLarge(BusError):
    """A save holds more messages than one atomic batch allows; it is refused, never split."""

    code = "batch_too_large"


class SnapshotsUnavailable(BusError):
    """The snapshot stream is missing (a deployment not yet upgraded): no snapshot is saved,
    and loads read their aggregates' whole histories."""

    code = "snapshots_unavailable"


class PayloadTooLarge(BusError):
    """The message is bigger than the server's max_payload; it was not sent."""

    code = "payload_too_large"


class PublishRejected(BusError):
    """JetStream refused a publish for a reason other than a concurrency conflict."""

    code = "publish_rejected"


# -- the tenants' file buckets (bus.objects) -------------------------------------------------


class BucketMissing(BusError):
    """The tenant's file bucket does not exist: the operator makes it with the tenant's user."""

    code = "bucket_missing"


class BucketQuotaExceeded(BusError):
    """The tenant's bucket has no room for the object under its quota; nothing of it is kept."""

    code = "bucket_quota_exceeded"


class BucketQuotaUnreservable(BusError):
    """The server's JetStream store cannot reserve a bucket's quota (the quotas of all buckets
    together pass its max_file_store): the bucket was not made or not changed."""

    code = "bucket_quota_unreservable"


class TelemetryRetentionUnreservable(BusError):
    """The server's JetStream store cannot reserve a tenant's telemetry retention (its stream's
    max_bytes, with every other stream's, passes max_file_store): the stream was not made or
    not changed."""

    code = "telemetry_retention_unreservable"


class ObjectMissing(BusError):
    """No object of that name is stored in the bucket (never stored, deleted or expired)."""

    code = "object_missing"


class DigestMismatch(BusError):
    """An object's bytes do not hash to the digest it is named or recorded by."""

    code = "digest_mismatch"


class SessionRefused(BusError):
    """An interactive session was refused by the plane or the lease's node; `code` says why."""

    code = "session_refused"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
