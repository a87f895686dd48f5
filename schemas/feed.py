"""Version 1 of the lease feed's wire types: the record of one lease state change, and a
tenant's replay request (`pool.cmd.<tenant>.feed.replay`)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from schemas.v1 import Count, SchemaVersion, SubjectToken, UnixSeconds

# the lease states and end reasons as the domain spells them: short lowercase words
StateName = Annotated[str, Meta(pattern=r"^[a-z_]{1,32}(?!\n)$", max_length=32)]
ReasonText = Annotated[str, Meta(max_length=256)]
EventName = Annotated[str, Meta(pattern=r"^[A-Za-z]{1,64}(?!\n)$", max_length=64)]


class FeedRecord(Struct, frozen=True, kw_only=True):
    """One state change of a lease, on `pool.feed.<tenant>.lease.<lease_id>`: what it became,
    from what, why, where, and the log event it was made from."""

    schema_version: SchemaVersion = 1
    lease_id: SubjectToken
    tenant: SubjectToken
    pool_id: SubjectToken
    state: StateName
    previous_state: StateName | None = None
    # the log event that made the change (LeaseReserved, LeaseReleased, …)
    event: EventName
    end_reason: ReasonText | None = None
    stop_reason: ReasonText | None = None
    rejection_code: ReasonText | None = None
    node_id: SubjectToken | None = None
    devices: Annotated[list[Annotated[str, Meta(max_length=128)]], Meta(max_length=64)] = []
    epoch: Count = 0
    exit_code: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    # which attempt of the lease (2, 3, … once retried); a retry's record names how the
    # attempt before it ended; a held lease says why it is held
    attempt: Annotated[int, Meta(ge=1, le=2**31)] = 1
    attempt_end_reason: ReasonText | None = None
    held_reason: ReasonText | None = None
    # the lease's version after the change, and the event's sequence in the log
    version: Count
    log_sequence: Count
    at: UnixSeconds


class FeedReplay(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A page of the tenant's own feed, read by the service on its behalf: after the feed
    sequence `after_seq` (0: from the oldest kept), one lease or all of them; `from_end`: no
    records, only `last_seq`, the feed's last sequence now (where a reader of what comes next
    starts). The tenant token comes from the subject, so a tenant never needs the right to
    create stream consumers."""

    schema_version: SchemaVersion = 1
    after_seq: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    lease: SubjectToken | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 500
    from_end: bool = False


PUBLIC_STRUCTS: tuple[type[Struct], ...] = (FeedRecord, FeedReplay)

