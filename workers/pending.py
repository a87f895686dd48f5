"""The folded aggregates a log follower keeps: whole objects, but a queued lease as a compact
record (its request's fields, the shape shared) until something needs the whole lease.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from datetime import datetime
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate
from eventsourcing.utils import get_topic

from domain.creation import initialised, lean_init
from domain.fold import lean_paths, mutate
from domain.gang import GangMembership
from domain.lease import Lease, LeaseState, queue_deadline
from domain.resources import Shape

_REQUESTED: type = Lease.LeaseRequested  # type: ignore[attr-defined]
_QUEUED: type = Lease.LeaseQueued  # type: ignore[attr-defined]
# the LeaseRequested fields a record keeps, in the event's own order (id, version and
# timestamp are the record's own: its key, 1, created_on)
_FIELDS: tuple[str, ...] = tuple(
    f for f in _REQUESTED.__dataclass_fields__  # type: ignore[attr-defined]
    if f not in ("originator_id", "originator_version", "timestamp"))
_READ_FIELDS = operator.itemgetter(*_FIELDS)
_SHAPE_AT = _FIELDS.index("shape")
_TENANT_AT = _FIELDS.index("tenant_id")
_POOL_AT = _FIELDS.index("pool_id")
_PRIORITY_AT = _FIELDS.index("priority_class")
_RUNTIME_AT = _FIELDS.index("maximum_runtime_seconds")
_REQUESTED_AT = _FIELDS.index("requested_at")
_DIGEST_AT = _FIELDS.index("request_digest")
_ADVANCE_AT = _FIELDS.index("advance_reservation_id")
# set when the request was queued by the same event (one event a request); absent or None
# when a LeaseQueued followed it (two events)
_QUEUED_AT = _FIELDS.index("queued_at")
_GANG_AT = _FIELDS.index("gang")
_QUEUE_TIMEOUT_AT = _FIELDS.index("queue_timeout_seconds")
_WORKFLOW_AT = _FIELDS.index("workflow")
_REPEATED_AT = tuple(_FIELDS.index(name) for name in (
    "originator_topic", "tenant_id", "pool_id", "priority_class", "maximum_runtime_seconds",
    "lease_seconds", "heartbeat_timeout_seconds"))
_HEX = frozenset("0123456789abcdef")


def _is_hex(text: str) -> bool:
    """Lowercase hex of whole bytes: what bytes.fromhex(text).hex() gives back unchanged."""
    return len(text) % 2 == 0 and not set(text) - _HEX


class _Missing:
    """The one marker of a field an old event does not carry; unpickled as that same one
    (the scheduler's checkpoint holds records that carry it)."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "_MISSING"

    def __repr__(self) -> str:
        return "_MISSING"


_MISSING: Any = _Missing()
_LEASE_TOPIC = get_topic(Lease)


# the request's fields Lease.__init__ takes, when a Lease may be built without the library
_LEAN_INIT = lean_init(Lease, _REQUESTED)
# those of them a record keeps, with where: a promotion builds the init's arguments in one pass
_INIT_AT: tuple[tuple[str, int], ...] = tuple(
    (name, _FIELDS.index(name)) for name in _LEAN_INIT or () if name in _FIELDS)
_SHAPES_LIMIT = 65_536  # distinct shapes shared; past this, records keep their own


class QueuedLease:
    """A queued lease as the scheduler reads it before placing it: what ordering, filtering
    and pricing need, and enough to rebuild the Lease (`LeaseMemory.promote`)."""

    __slots__ = ("created_on", "end", "id", "queued_at", "queued_on", "requested")

    state = LeaseState.QUEUED

    def __init__(self, oid: UUID, requested: tuple[Any, ...], created_on: datetime,
                 queued_on: datetime, queued_at: float, end: int = 0) -> None:
        self.id = oid
        self.requested = requested  # LeaseRequested's _FIELDS, the shape as a shared Shape
        self.created_on = created_on  # the LeaseRequested event's timestamp
        self.queued_on = queued_on  # the LeaseQueued event's timestamp (or the request's)
        self.queued_at = queued_at
        # the log sequence of its last event (0: not known): what its next save expects, so
        # that save needs no look-up when the recorder no longer remembers the subject
        self.end = end

    @property
    def version(self) -> int:
        """1 for a request queued by its own event, 2 for a request and a LeaseQueued."""
        return 1 if type(self.requested[_QUEUED_AT]) is float else 2

    @property
    def requested_shape(self) -> Shape:
        shape: Shape = self.requested[_SHAPE_AT]
        return shape

    @property
    def tenant_id(self) -> str:
        return str(self.requested[_TENANT_AT])

    @property
    def pool_id(self) -> str:
        return str(self.requested[_POOL_AT])

    @property
    def priority_class(self) -> str:
        return str(self.requested[_PRIORITY_AT])

    @property
    def maximum_runtime_seconds(self) -> int:
        return int(self.requested[_RUNTIME_AT])

    @property
    def requested_at(self) -> float:
        return float(self.requested[_REQUESTED_AT])

    @property
    def advance_reservation_id(self) -> str | None:
        value = self.requested[_ADVANCE_AT]
        return None if value is None or value is _MISSING else str(value)

    @property
    def gang(self) -> GangMembership | None:
        value = self.requested[_GANG_AT]
        return None if value is None or value is _MISSING else GangMembership.from_dict(value)

    @property
    def array_id(self) -> str | None:
        value = self._workflow.get("array_id")
        return None if value is None else str(value)

    @property
    def max_running(self) -> int | None:
        value = self._workflow.get("max_running")
        return None if value is None else int(value)

    @property
    def avoid_node(self) -> str | None:
        """Never set on a lease held compactly: only a retry (a later event) names one."""
        return None

    @property
    def _workflow(self) -> dict[str, Any]:
        value = self.requested[_WORKFLOW_AT]
        return value if type(value) is dict else {}

    def next_due_at(self) -> float | None:
        """When its queue timeout ends its wait (Lease.next_due_at for a queued lease)."""
        value = self.requested[_QUEUE_TIMEOUT_AT]
        return None if value is _MISSING else queue_deadline(self.queued_at, value)


class LeaseMemory:
    """A dict of aggregates by id, except that a lease whose log so far is exactly a queued
    LeaseRequested, or LeaseRequested + LeaseQueued, is held as a QueuedLease (about a third of the memory of
    the folded Lease). `get` and `[]` give the whole Lease, rebuilt from the record through
    the library's own fold and kept from then on; `peek` gives the record without that."""

    def __init__(self) -> None:
        self.full: dict[UUID, Aggregate] = {}
        self.queued: dict[UUID, QueuedLease] = {}
        # a LeaseRequested without its LeaseQueued yet: (fields, its timestamp)
        self._requested: dict[UUID, tuple[tuple[Any, ...], datetime]] = {}
        self._shapes: dict[Shape, Shape] = {}
        self._values: dict[tuple[type, Any], Any] = {}

    # -- as a dict --------------------------------------------------------------------------

    def get(self, oid: UUID, default: Any = None) -> Any:
        agg = self.full.get(oid)
        if agg is not None:
            return agg
        if oid in self.queued or oid in self._requested:
            return self.promote(oid)
        return default

    def __getitem__(self, oid: UUID) -> Any:
        agg = self.get(oid)
        if agg is None:
            raise KeyError(oid)
        return agg

    def __setitem__(self, oid: UUID, agg: Aggregate) -> None:
        self.queued.pop(oid, None)
        self._requested.pop(oid, None)
        self.full[oid] = agg

    def __contains__(self, oid: object) -> bool:
        return oid in self.full or oid in self.queued or oid in self._requested

    def __len__(self) -> int:
        return len(self.full) + len(self.queued) + len(self._requested)

    def pop(self, oid: UUID, default: Any = None) -> Any:
        if oid in self.queued or oid in self._requested:
            agg = self.promote(oid)
        else:
            agg = self.full.get(oid, default)
        self.full.pop(oid, None)
        return agg

    def keys(self) -> Iterator[UUID]:
        yield from self.full
        yield from self.queued
        yield from self._requested

    def values(self) -> Iterator[Any]:
        """Every aggregate, the compact ones rebuilt (not kept): for tests and tools."""
        for item in self.items():
            yield item[1]

    def items(self) -> Iterator[tuple[UUID, Any]]:
        yield from list(self.full.items())
        for oid in list(self.queued) + list(self._requested):
            yield oid, self._rebuild(oid)

    def clear(self) -> None:
        self.full.clear()
        self.queued.clear()
        self._requested.clear()

    # -- compact ------------------------------------------------------------------------------

    def version_of(self, oid: UUID) -> int | None:
        """The version folded so far, or None for an aggregate not held."""
        agg = self.full.get(oid)
        if agg is not None:
            return agg.version
        record = self.queued.get(oid)
        if record is not None:
            return record.version
        if oid in self._requested:
            return 1
        return None

    def peek(self, oid: UUID) -> Any:
        """The whole aggregate if held so, else the QueuedLease, else None; nothing is rebuilt."""
        agg = self.full.get(oid)
        if agg is not None:
            return agg
        return self.queued.get(oid)

    def requested(self, oid: UUID) -> dict[str, Any] | None:
        """The request's fields of a lease held compactly before its LeaseQueued (one held
        for its dependencies, or requested and not yet queued); None for any other."""
        held = self._requested.get(oid)
        if held is None:
            return None
        return {name: value for name, value in zip(_FIELDS, held[0], strict=True)
                if value is not _MISSING}

    def absorb(self, event: Any) -> QueuedLease | bool:
        """Fold `event` compactly if it is a lease's LeaseRequested or the LeaseQueued after it:
        the new QueuedLease (a request queued by its own event, or its LeaseQueued), True for
        a LeaseRequested that waits for its LeaseQueued, False for anything else (the caller
        folds that as usual, after `get` rebuilt the lease if it was compact)."""
        cls = type(event)
        oid = event.originator_id
        if cls is _REQUESTED:
            if event.originator_version != 1 or oid in self.full or oid in self.queued:
                return False
            state = event.__dict__
            try:  # every field at once: a backlog's read does this once per request
                fields = list(_READ_FIELDS(state))
            except KeyError:  # an event from before some field was added
                fields = [state.get(name, _MISSING) for name in _FIELDS]
            shared = self._values
            for at in _REPEATED_AT:  # the same few tenants, pools, classes and limits
                value = fields[at]
                key = (type(value), value)
                got = shared.get(key)
                if got is None:
                    if len(shared) < _SHAPES_LIMIT:
                        shared[key] = value
                else:
                    fields[at] = got
            digest = fields[_DIGEST_AT]
            if type(digest) is str and _is_hex(digest):
                fields[_DIGEST_AT] = bytes.fromhex(digest)  # half the memory; .hex() gives it back
            shape_dict = fields[_SHAPE_AT]
            if type(shape_dict) is not dict:
                return False
            try:
                fields[_SHAPE_AT] = self._shared(Shape.from_dict(shape_dict))
            except Exception:  # noqa: BLE001 - what the fold would refuse, the fold shall refuse
                return False
            queued_at = fields[_QUEUED_AT]
            if queued_at is _MISSING or queued_at is None:  # a LeaseQueued is to follow
                self._requested[oid] = (tuple(fields), event.timestamp)
                return True
            if type(queued_at) is not float:
                return False
            record = QueuedLease(oid, tuple(fields), event.timestamp, event.timestamp, queued_at)
            self.queued[oid] = record
            return record
        if cls is _QUEUED and event.originator_version == 2:
            held = self._requested.pop(oid, None)
            if held is None:
                return False
            at = event.__dict__.get("at", _MISSING)
            if type(at) is not float:
                self._requested[oid] = held
                return False
            # the LeaseRequested's timestamp is the lease's created_on; modified_on is this one
            record = QueuedLease(oid, held[0], held[1], event.timestamp, at)
            self.queued[oid] = record
            return record
        return False

    def compact(self, lease: Lease) -> bool:
        """Hold a whole Lease compactly again if its log is still just requested + queued and
        it has nothing unsaved (e.g. one examined by a cycle and left waiting)."""
        if (lease.version not in (1, 2) or lease.state is not LeaseState.QUEUED
                or lease._pending_events  # unsaved events must not be lost
                or self.full.get(lease.id) is not lease):
            return False
        requested = self._requested_fields(lease)
        if requested is None:
            return False
        del self.full[lease.id]
        self.queued[lease.id] = QueuedLease(lease.id, requested, lease.created_on,
                                            lease.modified_on, float(lease.queued_at or 0.0))
        return True

    def promote(self, oid: UUID) -> Aggregate:
        """The whole Lease for a compact one, kept as a whole object from now on."""
        agg = self._rebuild(oid)
        self.queued.pop(oid, None)
        self._requested.pop(oid, None)
        self.full[oid] = agg
        return agg

    # -- inside -------------------------------------------------------------------------------

    def _shared(self, shape: Shape) -> Shape:
        got = self._shapes.get(shape)
        if got is not None:
            return got
        if len(self._shapes) < _SHAPES_LIMIT:
            self._shapes[shape] = shape
        return shape

    def _rebuild(self, oid: UUID) -> Aggregate:
        """The Lease folded from the record's events, rebuilt as the log holds them."""
        record = self.queued.get(oid)
        if record is not None:
            fields, created_on = record.requested, record.created_on
        else:
            fields, created_on = self._requested[oid]
        lease: Aggregate
        if _LEAN_INIT is not None and lean_paths():
            # what CanInitAggregate.mutate does, less its per-call signature filtering; the
            # shared Shape is handed over as it is (Lease.__init__ takes one), not turned into
            # a dict to be parsed back: a backlog promotes every lease it places
            init = {name: fields[at] for name, at in _INIT_AT if fields[at] is not _MISSING}
            digest = init.get("request_digest")
            if type(digest) is bytes:
                init["request_digest"] = digest.hex()
            lease = initialised(Lease, oid, 1, created_on, init)
        else:
            kwargs: dict[str, Any] = {}
            for name, value in zip(_FIELDS, fields, strict=True):
                if value is not _MISSING:
                    kwargs[name] = value
            kwargs["shape"] = fields[_SHAPE_AT].to_dict()
            digest = kwargs.get("request_digest")
            if type(digest) is bytes:
                kwargs["request_digest"] = digest.hex()
            state = {"originator_id": oid, "originator_version": 1, "timestamp": created_on,
                     **kwargs}
            requested: Any = object.__new__(_REQUESTED)
            object.__setattr__(requested, "__dict__", _ordered(state, _REQUESTED))
            lease = requested.mutate(None)
        if record is not None and record.version == 2:
            queued: Any = object.__new__(_QUEUED)
            object.__setattr__(queued, "__dict__", {
                "originator_id": oid, "originator_version": 2,
                "timestamp": record.queued_on, "at": record.queued_at})
            lease = mutate(queued, lease)
        return lease

    def _requested_fields(self, lease: Lease) -> tuple[Any, ...] | None:
        """The record's fields for a whole queued Lease, read back from its attributes."""
        if type(lease) is not Lease:
            return None
        values: list[Any] = []
        for name in _FIELDS:
            if name == "shape":
                values.append(self._shared(lease.requested_shape))
            elif name == "originator_topic":
                values.append(_LEASE_TOPIC)
            elif name == "gang":
                gang = getattr(lease, name, None)
                values.append(None if gang is None else gang.to_dict())
            elif name == "queued_at":
                # queued by its request (version 1) or by a LeaseQueued (version 2)
                values.append(float(lease.queued_at or 0.0) if lease.version == 1 else _MISSING)
            elif name == "request_digest":
                digest = getattr(lease, name, _MISSING)
                values.append(bytes.fromhex(digest) if type(digest) is str and _is_hex(digest)
                              else digest)
            else:
                values.append(getattr(lease, name, _MISSING))
        return tuple(values)


def _ordered(state: dict[str, Any], cls: type) -> dict[str, Any]:
    """`state` in the dataclass's field order, as its own __init__ would have set them."""
    return {name: state[name] for name in cls.__dataclass_fields__  # type: ignore[attr-defined]
            if name in state}
