"""Version 1's reads: one lease's state and why it waits, the tenant's queue places, a
projection view, and a page of the tenant's telemetry.
"""

# msgspec gives each instance its own copy of a mutable default; ruff sees that only when
# msgspec.Struct is a base in the same file, not through the imported bases.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from schemas.v1_vocabulary import (
    CommandBase,
    NameToken,
    ShortText,
    SubjectToken,
    TelemetryKind,
    UnixSeconds,
)


class GetLease(CommandBase, frozen=True, kw_only=True):
    """Read one lease's current state (the lease id is in the subject)."""


class WhyLease(CommandBase, frozen=True, kw_only=True):
    """Ask why a lease is pending (per-reason node counts); `at`: the reason recorded then."""
    at: UnixSeconds | None = None


class QueuePositions(CommandBase, frozen=True, kw_only=True):
    """List the tenant's waiting leases with their places in the queue and estimated starts."""


class Query(CommandBase, frozen=True, kw_only=True):
    """Read a projection view (named in the subject), filtered and paged; `at`: as it was then."""

    filters: Annotated[dict[NameToken, ShortText], Meta(max_length=32)] = {}
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100
    cursor: Annotated[str, Meta(max_length=256)] | None = None
    at: UnixSeconds | None = None


class TelemetryReplay(CommandBase, frozen=True, kw_only=True):
    """A page of the tenant's own telemetry, read by the service for it (`pool.cmd.<tenant>.
    telemetry.replay`): from `since`, or after the stream sequence `after_seq` the last page ended
    on. The tenant token is the subject's: a tenant never needs (nor gets) stream consumers."""

    since: UnixSeconds | None = None
    after_seq: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    pool: SubjectToken | None = None
    node: SubjectToken | None = None
    lease: SubjectToken | None = None
    kind: TelemetryKind | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 500


