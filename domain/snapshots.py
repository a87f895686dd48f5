"""Snapshots of long-lived aggregates as explicit, versioned plain state: each snapshotted type
says what its state is (`snapshot_state`) and how to rebuild it (`restore_state`)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, cast

from eventsourcing.domain import Aggregate, Snapshot
from eventsourcing.utils import get_topic, resolve_topic

# what every aggregate's __dict__ holds besides its own fields
_BASE_FIELDS = frozenset({"_id", "_version", "_pending_events", "_created_on", "_modified_on"})


class UnusableSnapshot(Exception):
    """A snapshot this code cannot rebuild (a schema it has no upcast from, or newer than it):
    the aggregate is loaded from its whole history instead."""


class Snapshotted(Protocol):
    SNAPSHOT_SCHEMA: ClassVar[int]

    def snapshot_state(self) -> dict[str, Any]: ...

    @staticmethod
    def restore_state(state: dict[str, Any]) -> dict[str, Any]: ...


class StateSnapshot(Snapshot):
    """An aggregate at one version: `state` is `{"schema": n, "fields": {...}, "created_on",
    "modified_on"}`, the fields as the type's `snapshot_state` gives them (plain JSON values).
    A snapshot of an older schema is upcast by the type's `upcast_snapshot_v<n>_v<n+1>(fields)`
    where it has one; otherwise it is unusable (`UnusableSnapshot`)."""

    @classmethod
    def take(cls, aggregate: Any) -> StateSnapshot:
        agg = cast(Aggregate, aggregate)
        kind = cast(Snapshotted, type(agg))
        fields = cast(Snapshotted, agg).snapshot_state()
        own = set(vars(agg)) - _BASE_FIELDS
        if own != set(fields):
            # a field the snapshot forgets (or invents) would load as a different aggregate
            raise ValueError(f"{type(agg).__name__}.snapshot_state misses or adds fields: "
                             f"{sorted(own ^ set(fields))}")
        return cls(
            originator_id=agg.id,
            originator_version=agg.version,
            timestamp=cls.create_timestamp(),
            topic=get_topic(type(agg)),
            state={"schema": kind.SNAPSHOT_SCHEMA, "fields": fields,
                   "created_on": agg.created_on, "modified_on": agg.modified_on},
        )

    def usable(self) -> bool:
        """Whether this code can rebuild the aggregate from this snapshot: its class exists and
        has an upcast for every schema between the snapshot's and its own."""
        try:
            self._upcasts()
        except UnusableSnapshot:
            return False
        return True

    def _upcasts(self) -> tuple[type[Any], list[Any]]:
        try:
            cls = resolve_topic(self.topic)
        except Exception as e:  # a renamed or removed class: not this snapshot
            raise UnusableSnapshot(f"no class for {self.topic}") from e
        state = self.state if isinstance(self.state, dict) else {}
        schema = state.get("schema")
        current = getattr(cls, "SNAPSHOT_SCHEMA", None)
        if not isinstance(schema, int) or current is None or schema > current:
            raise UnusableSnapshot(f"{self.topic} snapshot schema {schema!r}, code {current!r}")
        upcasts = []
        for n in range(schema, current):
            upcast = getattr(cls, f"upcast_snapshot_v{n}_v{n + 1}", None)
            if upcast is None:
                raise UnusableSnapshot(f"{self.topic} has no upcast from snapshot v{n}")
            upcasts.append(upcast)
        return cls, upcasts

    def _fields(self) -> tuple[type[Any], dict[str, Any]]:
        cls, upcasts = self._upcasts()
        fields = dict(self.state.get("fields") or {})
        for upcast in upcasts:
            upcast(fields)
        return cls, fields

    def mutate(self, _: Any) -> Any:
        cls, fields = self._fields()
        aggregate = object.__new__(cls)
        created, modified = self.state.get("created_on"), self.state.get("modified_on")
        aggregate.__dict__.update(cls.restore_state(fields))
        aggregate.__dict__.update(
            _id=self.originator_id, _version=self.originator_version, _pending_events=[],
            _created_on=created if created is not None else self.timestamp,
            _modified_on=modified if modified is not None else self.timestamp)
        return aggregate
