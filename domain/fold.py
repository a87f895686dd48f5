"""The one fold of the log (`Fold`) and its lean steps, equal to the library's (ADR 012);
`use_lean_paths(False)` (POOL_FAST_PATHS=off, workers.fastpaths) sends both the library's way."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, Protocol

from eventsourcing.domain import (
    Aggregate,
    CanInitAggregate,
    CanMutateAggregate,
    DecoratedFuncCaller,
    OriginatorIDError,
    OriginatorVersionError,
    decorated_func_callers,
    decorated_funcs,
)

Lean = tuple[Callable[..., None], tuple[str, ...]] | None
_LEAN: dict[type, Lean] = {}
_Resolved = tuple[type, Callable[..., None], tuple[str, ...], frozenset[str]] | None
_RESOLVED: dict[tuple[type, str], _Resolved] = {}
_BASE_FIELDS = ("originator_id", "originator_version", "timestamp")
_LEAN_ON = True  # set once at process start by workers.fastpaths; on unless told otherwise


def use_lean_paths(on: bool) -> None:
    """Whether `trigger` and `mutate` take their lean paths (on) or the library's own (off):
    the domain's half of the one fast-path switch, set at process start, never read from the
    environment here."""
    global _LEAN_ON
    _LEAN_ON = bool(on)


def lean_paths() -> bool:
    """Whether the lean paths are on (`use_lean_paths`)."""
    return _LEAN_ON


def lean_mutator(cls: type) -> Lean:
    """(the @event method's function, its keyword names) when `cls.mutate(agg)` on a valid next
    event is exactly: call that function with the event's attributes it names, then set the
    aggregate's version and modified_on — the library's CanMutateAggregate.mutate with
    DecoratedFuncCaller.apply and nothing of ours in between; else None (the library's way)."""
    try:
        return _LEAN[cls]
    except KeyError:
        got = _LEAN[cls] = _lean_mutator(cls)
        return got


def _lean_mutator(cls: type) -> Lean:
    if not issubclass(cls, DecoratedFuncCaller) or cls.mutate is not CanMutateAggregate.mutate:
        return None
    seen_caller = False
    for klass in cls.__mro__:
        if "apply" not in vars(klass):
            continue
        if not seen_caller:
            if klass is not DecoratedFuncCaller:
                return None
            seen_caller = True
        else:  # what DecoratedFuncCaller.apply's super().apply() reaches: must be the no-op
            if klass is not CanMutateAggregate:
                return None
            break
    func = decorated_funcs.get(cls)
    if type(func) is not types.FunctionType:
        return None
    params = list(inspect.signature(func).parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                             inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return None
    names = []
    for p in params[1:]:
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            return None
        if p.kind is not inspect.Parameter.VAR_KEYWORD:  # the library passes named ones only
            names.append(p.name)
    return func, tuple(names)


def mutate(event: Any, agg: Aggregate) -> Aggregate:
    """`event.mutate(agg)` for the next event of an existing aggregate, through the lean path
    when `lean_mutator` allows it (same checks of id and version, same result)."""
    lean = lean_mutator(type(event)) if _LEAN_ON else None
    if lean is None:
        return event.mutate(agg)  # type: ignore[no-any-return]
    if event.originator_id != agg.id:
        raise OriginatorIDError(event.originator_id, agg.id)
    if event.originator_version != agg.version + 1:
        raise OriginatorVersionError(event.originator_version, agg.version + 1)
    func, names = lean
    state = event.__dict__
    func(agg, **{k: state[k] for k in names if k in state})
    agg.version = event.originator_version
    agg.modified_on = event.timestamp
    return agg


def _resolve(agg_type: type[Aggregate], method: str) -> _Resolved:
    decorator = None
    for klass in agg_type.__mro__:
        if method in vars(klass):
            decorator = vars(klass)[method]
            break
    event_cls = decorated_func_callers.get(decorator) if decorator is not None else None
    if event_cls is None or agg_type.trigger_event is not Aggregate.trigger_event:
        return None
    if lean_mutator(event_cls) is None:  # the library's mutate and apply, nothing in between
        return None
    names = tuple(getattr(event_cls, "__dataclass_fields__", {}))
    if names[:3] != _BASE_FIELDS:
        return None
    func = decorator.decorated_func  # type: ignore[union-attr]
    return event_cls, func, names[3:], frozenset(names[3:])


def trigger(agg: Aggregate, method: str, **fields: Any) -> None:
    """`agg.<method>(**fields)` for an `@event` method, through the lean path when it is
    equivalent. `fields` must name every field of the event (no defaults are filled in)."""
    key = (type(agg), method)
    try:
        resolved = _RESOLVED[key]
    except KeyError:
        resolved = _RESOLVED[key] = _resolve(type(agg), method)
    if resolved is None or not _LEAN_ON or fields.keys() != resolved[3]:
        getattr(agg, method)(**fields)
        return
    event_cls, func, names, _ = resolved
    version = agg.version + 1
    timestamp = event_cls.create_timestamp()  # type: ignore[attr-defined]
    event: Any = object.__new__(event_cls)
    # a frozen dataclass's __init__ sets each field with object.__setattr__, in field order
    state = {"originator_id": agg.id, "originator_version": version, "timestamp": timestamp}
    for name in names:
        state[name] = fields[name]
    object.__setattr__(event, "__dict__", state)
    func(agg, **fields)  # the method body: it may refuse, and then nothing is recorded
    agg.version = version
    agg.modified_on = timestamp
    agg._pending_events.append(event)


class AggregateMap(Protocol):
    """What a fold keeps its aggregates in: a dict, or a reader's own map."""

    def get(self, key: Any, /) -> Any: ...

    def __setitem__(self, key: Any, value: Any, /) -> None: ...


class Fold:
    """The one fold of the log: aggregates by id, each advanced by its next event. Readers
    configure it with their own map (the scheduler's compact memory, the views' bounded
    cache) and decide what an event that is not the next one means to them."""

    def __init__(self, aggregates: AggregateMap | None = None) -> None:
        self.aggregates: AggregateMap = {} if aggregates is None else aggregates

    def step(self, event: Any) -> Any:
        """The aggregate after `event`, kept in the map; None (the map untouched) when the event
        is neither the next version of the aggregate held nor the creation of one not held: a
        gap in what this reader has seen, or a version it already folded."""
        agg: Any = self.aggregates.get(event.originator_id)
        if agg is None:
            if not isinstance(event, CanInitAggregate):
                return None
            agg = event.mutate(None)
        elif event.originator_version == agg.version + 1:
            agg = mutate(event, agg)
        else:
            return None
        self.aggregates[agg.id] = agg
        return agg
