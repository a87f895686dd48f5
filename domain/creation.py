"""Aggregates built from their created event as the library builds them, less its per-call
generic work (argument coercion, signature filtering): for the paths that make one a request."""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from eventsourcing.domain import Aggregate, CanInitAggregate, CanMutateAggregate

A = TypeVar("A", bound=Aggregate)


def lean_init(aggregate: type[Aggregate], created: type) -> tuple[str, ...] | None:
    """`aggregate.__init__`'s keyword names when folding its `created` event is exactly: a new
    object, the library's base init, then `__init__` with the event's fields it names (the
    event's mutate and apply the library's own, the init not asking for the id, no explicit
    topic); else None, and the caller goes through the library."""
    if (getattr(created, "mutate", None) is not CanInitAggregate.mutate
            or getattr(created, "apply", None) is not CanMutateAggregate.apply
            or getattr(aggregate, "TOPIC", None)):
        return None
    params = list(inspect.signature(aggregate.__init__).parameters.values())[1:]
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or p.name == "id"
           for p in params):
        return None
    return tuple(p.name for p in params)


def initialised(aggregate: type[A], originator_id: Any, originator_version: int,
                timestamp: Any, fields: dict[str, Any]) -> A:
    """What `CanInitAggregate.mutate` makes of a created event carrying `fields` (those
    `lean_init` names), made directly."""
    made = aggregate.__new__(aggregate)
    made.__base_init__(originator_id=originator_id, originator_version=originator_version,
                       timestamp=timestamp)
    aggregate.__init__(made, **fields)
    return made
